// Command tokentap is a transparent, measuring reverse proxy for LLM
// inference servers.
//
//	tokentap -upstream http://127.0.0.1:8000          # proxy :8080 → backend
//	tokentap -config configs/tokentap.yaml            # routes, models, timeouts
//	tokentap demo                                     # simulated backend + traffic
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/pprofhandler"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "demo" {
		if err := runDemo(os.Args[2:], os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "tokentap demo:", err)
			os.Exit(1)
		}
		return
	}
	if err := run(os.Args[1:], nil); err != nil {
		fmt.Fprintln(os.Stderr, "tokentap:", err)
		os.Exit(2)
	}
}

// parseFlags parses the command line and loads the config file it names.
func parseFlags(args []string) (*settings, error) {
	fs := flag.NewFlagSet("tokentap", flag.ContinueOnError)
	var f flags
	fs.StringVar(&f.listen, "listen", ":8080", "address the proxy listens on")
	fs.StringVar(&f.admin, "admin", "127.0.0.1:9090", "admin listener for /metrics and /healthz (empty: off)")
	fs.StringVar(&f.upstream, "upstream", "", "upstream base URL; alone, or with a config without routes, it makes the route \"default\"")
	fs.StringVar(&f.config, "config", "", "YAML config file (see configs/tokentap.yaml)")
	fs.StringVar(&f.accessLog, "access-log", "-", "access log path, - for stdout, empty to disable")
	if err := fs.Parse(args); err != nil {
		return nil, err
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
	return buildSettings(fc, f)
}

// run starts tokentap and blocks until SIGINT/SIGTERM (or until stop is
// closed, for tests), then drains.
func run(args []string, stop <-chan struct{}) error {
	s, err := parseFlags(args)
	if err != nil {
		return err
	}
	logger, _ := zap.NewProduction()
	defer func() { _ = logger.Sync() }()

	var sinks []metrics.Sink
	var alog *metrics.AccessLog
	if s.accessLog != "" {
		w, closeW, err := openLog(s.accessLog)
		if err != nil {
			return fmt.Errorf("access-log: %w", err)
		}
		defer closeW()
		alog = metrics.NewAccessLog(w, 0)
		sinks = append(sinks, alog)
	}
	s.opts.Sinks = sinks
	s.opts.Logger = logger
	p, err := proxy.New(s.proxy, s.opts)
	if err != nil {
		return err
	}
	defer p.Close()

	ln, err := p.Listen(s.listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	// reload re-reads the config with the same flags, validates it fully and
	// swaps it in; a bad file keeps the running config. Streams in flight
	// finish on the config they started with.
	var reloadMu sync.Mutex
	reload := func() error {
		reloadMu.Lock()
		defer reloadMu.Unlock()
		next, err := parseFlags(args)
		if err == nil {
			err = p.Apply(next.proxy)
		}
		if err != nil {
			logger.Error("config reload failed, keeping the running config", zap.Error(err))
			return err
		}
		if next.listen != s.listen || next.admin != s.admin || next.accessLog != s.accessLog {
			logger.Warn("listen, admin and access_log take effect only on restart")
		}
		logger.Info("config reloaded", zap.Int("routes", len(next.proxy.Routes)))
		return nil
	}
	srv := p.Server()
	go func() {
		if err := srv.Serve(ln); err != nil {
			logger.Error("proxy server stopped", zap.Error(err))
		}
	}()
	var admin *fasthttp.Server
	if s.admin != "" {
		aln, err := net.Listen("tcp", s.admin)
		if err != nil {
			_ = srv.Shutdown()
			return fmt.Errorf("admin: %w", err)
		}
		admin = &fasthttp.Server{Handler: adminHandler(reload), Name: "tokentap-admin"}
		go func() { _ = admin.Serve(aln) }()
	}
	logger.Info("tokentap started", zap.String("listen", ln.Addr().String()), zap.String("admin", s.admin),
		zap.Int("routes", len(s.proxy.Routes)))

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sig)
wait:
	for {
		select {
		case got := <-sig:
			if got == syscall.SIGHUP {
				_ = reload()
				continue
			}
			break wait
		case <-stop:
			break wait
		}
	}
	logger.Info("draining")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := srv.ShutdownWithContext(ctx); err != nil {
		logger.Warn("drain incomplete", zap.Error(err))
	}
	if admin != nil {
		_ = admin.Shutdown()
	}
	if alog != nil {
		alog.Close()
	}
	return nil
}

func openLog(path string) (zapcore.WriteSyncer, func(), error) {
	if path == "-" {
		return zapcore.Lock(os.Stdout), func() {}, nil
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, nil, err
	}
	return zapcore.Lock(f), func() { _ = f.Close() }, nil
}

// adminHandler serves /metrics (Prometheus text), /healthz, POST
// /-/reload and Go's profiles under /debug/pprof/.
func adminHandler(reload func() error) fasthttp.RequestHandler {
	return func(ctx *fasthttp.RequestCtx) {
		switch string(ctx.Path()) {
		case "/metrics":
			ctx.SetContentType("text/plain; version=0.0.4")
			vm.WritePrometheus(ctx, true)
		case "/healthz":
			ctx.SetContentType("text/plain")
			ctx.SetBodyString("ok\n")
		case "/debug/pprof/", "/debug/pprof/profile", "/debug/pprof/heap", "/debug/pprof/allocs", "/debug/pprof/goroutine", "/debug/pprof/trace",
			"/debug/pprof/cmdline", "/debug/pprof/symbol", "/debug/pprof/block", "/debug/pprof/mutex", "/debug/pprof/threadcreate":
			pprofhandler.PprofHandler(ctx)
		case "/-/reload":
			if !ctx.IsPost() {
				ctx.SetStatusCode(fasthttp.StatusMethodNotAllowed)
				ctx.SetBodyString("use POST\n")
				return
			}
			if err := reload(); err != nil {
				ctx.SetStatusCode(fasthttp.StatusBadRequest)
				ctx.SetBodyString("reload failed, running config kept: " + err.Error() + "\n")
				return
			}
			ctx.SetBodyString("reloaded\n")
		default:
			ctx.SetStatusCode(fasthttp.StatusNotFound)
			ctx.SetBodyString("not found\n")
		}
	}
}
