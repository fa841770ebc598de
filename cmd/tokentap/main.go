// Command tokentap is a transparent, measuring reverse proxy for LLM
// inference servers.
//
//	tokentap -upstream http://127.0.0.1:8000          # proxy :8080 → backend
//	tokentap -config configs/tokentap.yaml            # routes, models, timeouts
//	tokentap demo [-serve 127.0.0.1:9090]             # simulated backend + traffic (+ dashboard)
//	tokentap stats -admin http://127.0.0.1:9090       # the live percentile table
//	tokentap compare -route chat [stable canary]      # the verdict on two upstreams
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/telemetry"
	"github.com/tokentap/tokentap/proxy"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// subcommands are tokentap's commands beside the proxy itself, with the
// line -h prints for each.
// (a function: the table refers to run, whose reload refers back to it).
func subcommands() []subcommand {
	return []subcommand{
		{"demo", "a simulated backend, tokentap in front of it and a burst of traffic; -serve keeps it running with the dashboard", runDemo},
		{"stats", "print a running tokentap's live percentiles (/stats) as a table", runStats},
		{"compare", "print the verdict on two upstreams of a route of a running tokentap", runCompare},
	}
}

type subcommand struct {
	name, usage string
	run         func(context.Context, []string, io.Writer) error
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if len(os.Args) > 1 {
		for _, sc := range subcommands() {
			if os.Args[1] != sc.name {
				continue
			}
			if err := sc.run(ctx, os.Args[2:], os.Stdout); err != nil {
				if errors.Is(err, flag.ErrHelp) {
					return
				}
				fmt.Fprintf(os.Stderr, "tokentap %s: %v\n", os.Args[1], err)
				os.Exit(1)
			}
			return
		}
	}
	if err := run(ctx, os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) || errors.Is(err, errPrinted) {
			return
		}
		fmt.Fprintln(os.Stderr, "tokentap:", err)
		os.Exit(2)
	}
}

// otelShutdown bounds the wait at exit for the OTel export's last batch:
// with the clients' half second to close, a collector that does not answer
// holds the exit 2 s at most.
const otelShutdown = 1500 * time.Millisecond

// errPrinted ends a run that only printed something: the version, or
// "config ok" for -check.
var errPrinted = errors.New("version printed")

// usage is -h's text above the flags.
func usage(fs *flag.FlagSet) func() {
	return func() {
		w := fs.Output()
		fmt.Fprintf(w, "tokentap: a transparent, measuring reverse proxy for LLM inference servers.\n\n")
		fmt.Fprintf(w, "Usage:\n  tokentap %-24s %s\n", "[flags]", "run the proxy")
		for _, sc := range subcommands() {
			fmt.Fprintf(w, "  tokentap %-24s %s\n", sc.name+" [flags]", sc.usage)
		}
		fmt.Fprintf(w, "\n`tokentap COMMAND -h` lists a command's flags.\n\nFlags:\n")
		fs.PrintDefaults()
	}
}

// newLogger is the process log: JSON lines with ISO-8601 timestamps, the
// level and the caller, no stack traces (a refused reload or a failed
// write is routine: its reason, file and line say enough).
func newLogger() *zap.Logger {
	cfg := zap.NewProductionConfig()
	cfg.EncoderConfig.TimeKey = "time"
	cfg.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	cfg.DisableStacktrace = true
	logger, err := cfg.Build()
	if err != nil {
		return zap.NewNop()
	}
	return logger
}

// parseFlags parses the command line and loads the config file it names.
func parseFlags(args []string) (*settings, error) {
	fs := flag.NewFlagSet("tokentap", flag.ContinueOnError)
	var f flags
	fs.StringVar(&f.listen, "listen", ":8080", "address the proxy listens on")
	fs.StringVar(&f.admin, "admin", "127.0.0.1:9090", "admin listener: /metrics, /healthz, /readyz, /-/reload, /-/reopen, /debug/pprof/ (empty: off)")
	fs.StringVar(&f.upstream, "upstream", "", "upstream base URL; alone, or with a config without routes, it makes the route \"default\"")
	fs.StringVar(&f.config, "config", "", "YAML config file (see configs/tokentap.yaml)")
	fs.StringVar(&f.accessLog, "access-log", "-", "access log path, - for stdout, empty to disable")
	fs.BoolVar(&f.watchConfig, "watch-config", false, "reload when the config file changes (a Kubernetes ConfigMap), as on SIGHUP")
	fs.StringVar(&f.slo, "slo", "", "the default objectives, over the config file's: ttft=500ms,tpot=50ms (also ttfa, e2e, qoe=0.9, target=0.99); goodput is judged by them")
	showVersion := fs.Bool("version", false, "print the version and exit")
	check := fs.Bool("check", false, "check the config (with the flags) and exit: 0 when tokentap would start with it")
	fs.SetOutput(io.Discard) // errors are returned; -h prints the usage to stdout
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(os.Stdout)
			usage(fs)()
			return nil, err
		}
		return nil, fmt.Errorf("%w (tokentap -h lists the flags)", err)
	}
	if *showVersion {
		fmt.Println(versionLine())
		return nil, errPrinted
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	f.set = map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { f.set[fl.Name] = true })
	var fc *fileConfig
	if f.config != "" {
		var err error
		if fc, err = loadFile(f.config); err != nil {
			return nil, err
		}
	}
	s, err := buildSettings(fc, f)
	if err == nil && *check {
		if err = s.proxy.Validate(); err == nil {
			for _, w := range s.proxy.Warnings() {
				fmt.Println("warning:", w)
			}
			fmt.Println("config ok")
			return nil, errPrinted
		}
	}
	return s, err
}

// run starts tokentap and blocks until ctx is done (main's ends on SIGINT
// or SIGTERM), reloading on SIGHUP and reopening the access log on
// SIGUSR1; then it drains: /readyz turns 503 (/healthz stays 200),
// after drain_delay the listener closes, requests in flight run to their
// end for up to drain_timeout, and what is still running then is cut and
// recorded (outcome shutdown) before the access log is closed.
func run(ctx context.Context, args []string) error {
	s, err := parseFlags(args)
	if err != nil {
		return err
	}
	logger := newLogger()
	defer func() { _ = logger.Sync() }()
	ver, rev := buildVersion()
	metrics.SetBuildInfo(ver, rev)

	s.opts.Logger = logger
	alog, otel, err := startSinks(ctx, s, ver, logger)
	if err != nil {
		return err
	}
	p, err := proxy.New(s.proxy, s.opts)
	if err != nil {
		return err
	}
	defer p.Close()

	a := &admin{logger: logger, args: args, running: s, p: p, alog: alog}
	if a.certs, err = startCerts(ctx, s.tls, "tls", logger); err != nil {
		return err
	}
	if a.adminCerts, err = startCerts(ctx, s.adminTLS, "admin.tls", logger); err != nil {
		return err
	}
	var ln net.Listener
	if a.certs != nil {
		ln, err = p.ListenTLS(s.listen, a.certs.Config())
	} else {
		ln, err = p.Listen(s.listen)
	}
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	a.ready.Store(true)
	if err := a.loadToken(s); err != nil {
		return fmt.Errorf("admin.token_file: %w", err)
	}
	go func() {
		if err := p.Serve(ln); err != nil {
			logger.Error("proxy server stopped", zap.Error(err))
		}
	}()
	adminSrv, err := a.serveAdmin(s.admin)
	if err != nil {
		_ = p.Shutdown(context.Background())
		return fmt.Errorf("admin: %w", err)
	}
	started := time.Now()
	logger.Info("tokentap started", zap.String("listen", ln.Addr().String()), zap.String("admin", s.admin),
		zap.Int("routes", len(s.proxy.Routes)))

	if s.watchConfig && s.configFile != "" {
		go watchConfig(ctx, s.configFile, a)
	}
	a.answerSignals(ctx)
	a.drain()
	if adminSrv != nil {
		_ = adminSrv.Shutdown()
	}
	stopSinks(alog, otel, logger)
	logger.Info("tokentap stopped", zap.Stringer("uptime", time.Since(started).Round(time.Millisecond)))
	return nil
}

// startSinks opens the access log and the OTel exporter that s asks for
// and adds them to its options' sinks (the exporter as the tracer too).
func startSinks(ctx context.Context, s *settings, ver string, logger *zap.Logger) (*metrics.AccessLog, *telemetry.Exporter, error) {
	var alog *metrics.AccessLog
	var err error
	if s.accessLog != "" {
		if alog, err = metrics.OpenAccessLog(s.accessLog, 0); err != nil {
			return nil, nil, fmt.Errorf("access-log: %w", err)
		}
		s.opts.Sinks = append(s.opts.Sinks, alog)
	}
	if s.otel == nil {
		return alog, nil, nil
	}
	c := *s.otel
	c.ServiceVersion = ver
	c.OnError = func(err error) {
		logger.Warn("otel: export failing (counted in tokentap_otel_export_errors_total; logged at most once a minute)", zap.Error(err))
	}
	otel, err := telemetry.New(ctx, c)
	if err != nil {
		if alog != nil {
			alog.Close()
		}
		return nil, nil, fmt.Errorf("otel: %w", err)
	}
	if c.Traces {
		s.opts.Tracer = otel
	}
	s.opts.Sinks = append(s.opts.Sinks, otel)
	return alog, otel, nil
}

// stopSinks closes the access log and sends what the exporter holds,
// within a bound: a collector that is down must not hold the exit.
func stopSinks(alog *metrics.AccessLog, otel *telemetry.Exporter, logger *zap.Logger) {
	if alog != nil {
		alog.Close()
	}
	if otel != nil {
		// At most otelShutdown (and the clients' half second to close) for
		// a collector that does not answer: the exit never waits on it.
		sctx, cancel := context.WithTimeout(context.Background(), otelShutdown)
		if err := otel.Shutdown(sctx); err != nil {
			logger.Warn("otel: export at shutdown incomplete", zap.Error(err))
		}
		cancel()
	}
}

// serveAdmin starts the admin listener at addr (none when empty).
func (a *admin) serveAdmin(addr string) (*fasthttp.Server, error) {
	if addr == "" {
		return nil, nil
	}
	aln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	srv := a.server()
	var l net.Listener = newAdminListener(aln)
	if a.adminCerts != nil {
		l = tls.NewListener(l, a.adminCerts.Config())
	}
	go func() { _ = srv.Serve(l) }()
	return srv, nil
}

// answerSignals reloads the configuration on SIGHUP and reopens the
// access log on SIGUSR1, until ctx is done.
func (a *admin) answerSignals(ctx context.Context) {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGHUP, syscall.SIGUSR1)
	defer signal.Stop(sig)
	for ctx.Err() == nil {
		select {
		case got := <-sig:
			if got == syscall.SIGHUP {
				_ = a.reload()
			} else {
				_ = a.reopen()
			}
		case <-ctx.Done():
		}
	}
}

// watchConfig reloads when the config file changes (its size, time or
// inode: a ConfigMap's update swaps a symbolic link), until ctx is done.
func watchConfig(ctx context.Context, path string, a *admin) {
	proxy.WatchFiles(ctx, certWatchEvery, func() []string { return []string{path} }, func() {
		a.logger.Info("the config file changed, reloading")
		_ = a.reload()
	})
}

// certWatchEvery is how often the TLS listeners' files are looked at for
// a renewed certificate.
const certWatchEvery = 5 * time.Second

// startCerts reads a TLS listener's files (nil: a plain listener) and
// watches them for as long as ctx lasts.
func startCerts(ctx context.Context, f *proxy.ServerTLSFiles, field string, logger *zap.Logger) (*proxy.ServerTLS, error) {
	if f == nil {
		return nil, nil
	}
	c, err := proxy.NewServerTLS(*f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", field, err)
	}
	go c.Watch(ctx, certWatchEvery, func(err error) {
		if err != nil {
			logger.Warn("the certificate files changed and cannot be read, keeping those in use", zap.String("field", field), zap.Error(err))
			return
		}
		serial, subject, notAfter := c.Serving()
		logger.Info("serving a renewed certificate", zap.String("field", field), zap.String("serial", serial),
			zap.String("subject", subject), zap.Time("not_after", notAfter))
	})
	return c, nil
}

// drain stops the proxy without losing a record: readiness fails first, so
// load balancers stop sending; then the listener closes and requests in
// flight finish; those still running after drain_timeout are cut.
func (a *admin) drain() {
	s := a.settings()
	a.ready.Store(false)
	a.logger.Info("draining", zap.Stringer("drain_delay", s.drainDelay), zap.Stringer("drain_timeout", s.drainTimeout),
		zap.Int("in_flight", a.p.InFlight()))
	if s.drainDelay > 0 {
		time.Sleep(s.drainDelay)
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.drainTimeout)
	defer cancel()
	if err := a.p.Shutdown(ctx); err != nil {
		n := a.p.InFlight()
		ok := a.p.Cut(5 * time.Second)
		a.logger.Warn("drain timeout reached, requests in flight cut", zap.Int("cut", n), zap.Bool("all_recorded", ok))
	}
}
