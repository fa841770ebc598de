package main

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"net"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/pprofhandler"
	"go.uber.org/zap"
)

// admin is the admin listener's state: the running settings, readiness,
// the optional bearer token, and the reload and reopen actions that
// signals and endpoints share.
type admin struct {
	logger *zap.Logger
	args   []string
	p      *proxy.Proxy
	alog   *metrics.AccessLog // nil: no access log
	// certs serve the proxy's and the admin's TLS listeners (nil: plain),
	// read again on reload and when their files change.
	certs, adminCerts *proxy.ServerTLS

	mu      sync.Mutex // one reload at a time; guards running
	running *settings
	token   atomic.Pointer[string]   // nil or "": no token required
	hosts   atomic.Pointer[[]string] // admin.hosts: names allowed in Host without a token
	ready   atomic.Bool
}

func (a *admin) settings() *settings {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.running
}

// loadToken reads the bearer token file of s, if it names one, and takes
// its admin.hosts.
func (a *admin) loadToken(s *settings) error {
	a.hosts.Store(&s.adminHosts)
	tok := ""
	if s.adminTokenFile != "" {
		var err error
		if tok, err = readToken(s.adminTokenFile); err != nil {
			return err
		}
	}
	a.token.Store(&tok)
	return nil
}

// reload re-reads the config with the same flags, validates it fully and
// swaps it in; a bad file keeps the running config. Streams in flight
// finish on the config they started with. The admin token file is read
// again.
func (a *admin) reload() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	next, err := parseFlags(a.args)
	if err == nil {
		err = a.p.Apply(next.proxy)
	}
	if err == nil {
		err = a.loadToken(next)
	}
	if err != nil {
		a.logger.Warn("config reload refused, keeping the running config", zap.Error(err))
		return err
	}
	s := a.running
	if next.listen != s.listen || next.admin != s.admin || next.accessLog != s.accessLog || !reflect.DeepEqual(next.otel, s.otel) ||
		(next.tls == nil) != (s.tls == nil) || (next.adminTLS == nil) != (s.adminTLS == nil) ||
		next.opts.GoroutineRelay != s.opts.GoroutineRelay || next.opts.NoStats != s.opts.NoStats ||
		next.opts.NoSeries != s.opts.NoSeries || next.opts.NoClientSide != s.opts.NoClientSide {
		a.logger.Warn("listen, admin, access_log, relay, measurement, otel and turning tls on or off take effect only on restart")
	}
	next.opts.GoroutineRelay, next.opts.NoStats, next.opts.NoSeries, next.opts.NoClientSide =
		s.opts.GoroutineRelay, s.opts.NoStats, s.opts.NoSeries, s.opts.NoClientSide
	a.reloadCerts(a.certs, next.tls, "tls")
	a.reloadCerts(a.adminCerts, next.adminTLS, "admin.tls")
	if (next.tls == nil) != (s.tls == nil) {
		next.tls = s.tls
	}
	if (next.adminTLS == nil) != (s.adminTLS == nil) {
		next.adminTLS = s.adminTLS
	}
	next.otel = s.otel
	next.listen, next.admin, next.accessLog = s.listen, s.admin, s.accessLog
	a.running = next
	a.logger.Info("config reloaded", zap.Int("routes", len(next.proxy.Routes)))
	return nil
}

// reloadCerts reads a TLS listener's files again, those of the new config.
func (a *admin) reloadCerts(c *proxy.ServerTLS, f *proxy.ServerTLSFiles, field string) {
	if c == nil || f == nil {
		return
	}
	if err := c.Reload(*f); err != nil {
		a.logger.Warn("cannot read the certificates again, keeping those in use", zap.String("field", field), zap.Error(err))
	}
}

// reopen starts a new access log file after a rotation.
func (a *admin) reopen() error {
	if a.alog == nil {
		return nil
	}
	if err := a.alog.Reopen(); err != nil {
		a.logger.Error("cannot reopen the access log, still writing to the old file", zap.Error(err))
		return err
	}
	a.logger.Info("access log reopened")
	return nil
}

// server is the admin listener: a short read timeout for a request's
// headers and body, bounded idle connections, and few connections (its
// listener, newAdminListener, caps them per address and in all, with a
// budget of its own for probes and scrapes), so that it cannot be held
// open or flooded. No write timeout: a CPU profile takes as long as it
// was asked for.
func (a *admin) server() *fasthttp.Server {
	return &fasthttp.Server{
		Handler:        a.handle,
		Name:           "tokentap-admin",
		ReadTimeout:    3 * time.Second,
		IdleTimeout:    30 * time.Second,
		Concurrency:    adminConns + adminProbeConnsIn,
		ReadBufferSize: 8 << 10,
		NoDefaultDate:  true,
		// Plain HTTP sent to a TLS admin listener gets a plain-text 400
		// saying so, instead of a closed connection (read as EOF).
		ErrorHandler: func(ctx *fasthttp.RequestCtx, err error) {
			if proxy.AnswerPlainHTTP(err) {
				ctx.SetConnectionClose()
				return
			}
			var ne net.Error
			switch {
			case errors.As(err, &ne) && ne.Timeout():
				ctx.SetStatusCode(fasthttp.StatusRequestTimeout)
			case errors.Is(err, fasthttp.ErrBodyTooLarge):
				ctx.SetStatusCode(fasthttp.StatusRequestEntityTooLarge)
			default:
				ctx.SetStatusCode(fasthttp.StatusBadRequest)
			}
		},
		// Its error lines would quote a client's request bytes.
		SecureErrorLogMessage: true,
		Logger:                proxy.ServerLogger(a.logger.Named("admin")),
	}
}

// handle serves /metrics (Prometheus text), /healthz (the process runs),
// /readyz (it takes traffic: 503 while draining), POST /-/reload, POST
// /-/reopen and Go's profiles under /debug/pprof/. With a token
// configured, every endpoint but /healthz and /readyz requires
// "Authorization: Bearer <token>".
func (a *admin) handle(ctx *fasthttp.RequestCtx) {
	path := string(ctx.Path())
	if probeOnly(ctx) {
		// Past the caps: one probe or scrape, then the connection goes.
		ctx.SetConnectionClose()
		if !probePath(path) {
			ctx.SetStatusCode(fasthttp.StatusTooManyRequests)
			ctx.SetBodyString("too many connections from this address\n")
			return
		}
	}
	if a.serveOpen(ctx, path) || !a.browserAllowed(ctx) {
		return
	}
	if name, ok := strings.CutPrefix(path, "/dashboard/"); ok {
		serveAsset(ctx, name)
		return
	}
	if !a.authorized(ctx) {
		ctx.Response.Header.Set("WWW-Authenticate", `Bearer realm="tokentap-admin"`)
		ctx.SetStatusCode(fasthttp.StatusUnauthorized)
		ctx.SetBodyString("a bearer token is required\n")
		return
	}
	a.serveAuthorized(ctx, path)
}

// serveOpen answers the paths that need no token (the probes, the
// dashboard's page); false for any other.
func (a *admin) serveOpen(ctx *fasthttp.RequestCtx, path string) bool {
	switch path {
	case "/healthz":
		ctx.SetContentType("text/plain")
		ctx.SetBodyString("ok\n")
	case "/", "/dashboard", "/dashboard/":
		// The page and its assets hold no data: they load without the
		// token and send it (asked for on a 401) with each data request.
		serveAsset(ctx, "index.html")
	case "/readyz":
		ctx.SetContentType("text/plain")
		if !a.ready.Load() {
			ctx.SetStatusCode(fasthttp.StatusServiceUnavailable)
			ctx.SetBodyString("draining\n")
			return true
		}
		ctx.SetBodyString("ready\n")
	default:
		return false
	}
	return true
}

// browserAllowed refuses, without a token, what a browser must not reach:
// a Host that does not name this listener (DNS rebinding sends the page's
// own name), and a state change from another site's page.
func (a *admin) browserAllowed(ctx *fasthttp.RequestCtx) bool {
	if tok := a.token.Load(); tok != nil && *tok != "" {
		return true
	}
	var hosts []string
	if h := a.hosts.Load(); h != nil {
		hosts = *h
	}
	if !hostAllowed(string(ctx.Host()), hosts) {
		ctx.SetStatusCode(fasthttp.StatusForbidden)
		ctx.SetBodyString("this Host is not allowed: use an IP address or localhost, or list the name in admin.hosts\n")
		return false
	}
	if ctx.IsPost() && crossSite(ctx) {
		ctx.SetStatusCode(fasthttp.StatusForbidden)
		ctx.SetBodyString("a cross-site call is refused\n")
		return false
	}
	return true
}

// serveAuthorized answers the data and control paths, once authorized.
func (a *admin) serveAuthorized(ctx *fasthttp.RequestCtx, path string) {
	if (path == "/stats" || path == "/stats/timeline") && a.p.StatsOff() {
		ctx.SetStatusCode(fasthttp.StatusNotFound)
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"error":"the live stats are off (measurement.stats: false)"}` + "\n")
		return
	}
	switch path {
	case "/stats":
		a.serveStats(ctx)
	case "/guards":
		ctx.SetContentType("application/json")
		writeJSON(ctx, a.p.GuardStates())
	case "/stats/timeline":
		ctx.SetContentType("application/json")
		writeJSON(ctx, a.p.Stats().TimelineOf(string(ctx.QueryArgs().Peek("route")), ctx.QueryArgs().Has("upstreams")))
	case "/metrics":
		ctx.SetContentType("text/plain; version=0.0.4")
		metrics.WritePrometheus(ctx, true)
	case "/debug/pprof/", "/debug/pprof/profile", "/debug/pprof/heap", "/debug/pprof/allocs", "/debug/pprof/goroutine", "/debug/pprof/trace",
		"/debug/pprof/cmdline", "/debug/pprof/symbol", "/debug/pprof/block", "/debug/pprof/mutex", "/debug/pprof/threadcreate":
		pprofhandler.PprofHandler(ctx)
	case "/-/guard/reset", "/-/reload", "/-/reopen":
		if !ctx.IsPost() {
			ctx.SetStatusCode(fasthttp.StatusMethodNotAllowed)
			ctx.SetBodyString("use POST\n")
			return
		}
		a.control(ctx, path)
	default:
		ctx.SetStatusCode(fasthttp.StatusNotFound)
		ctx.SetBodyString("not found\n")
	}
}

// control runs a POSTed control call: a guard's reset, a reload, a
// reopen of the access log.
func (a *admin) control(ctx *fasthttp.RequestCtx, path string) {
	switch path {
	case "/-/guard/reset":
		if !a.p.ResetGuard(string(ctx.QueryArgs().Peek("route"))) {
			ctx.SetBodyString("no tripped guard\n")
			return
		}
		ctx.SetBodyString("reset\n")
	case "/-/reopen":
		if err := a.reopen(); err != nil {
			ctx.SetStatusCode(fasthttp.StatusInternalServerError)
			ctx.SetBodyString("reopen failed, still writing to the old file: " + err.Error() + "\n")
			return
		}
		ctx.SetBodyString("reopened\n")
	case "/-/reload":
		if err := a.reload(); err != nil {
			ctx.SetStatusCode(fasthttp.StatusBadRequest)
			ctx.SetBodyString("reload failed, running config kept: " + err.Error() + "\n")
			return
		}
		ctx.SetBodyString("reloaded\n")
	}
}

// serveStats answers GET /stats: the live percentile table as JSON
// (docs/STATS.md), for window (1m, 5m, 15m, 1h, all; default 5m), filtered by
// route, model, tenant, upstream and class, grouped by group_by (a comma
// list of those labels; default the first four); with route=R&compare=A,B,
// the verdict on two upstreams of R instead (of one class with class=).
func (a *admin) serveStats(ctx *fasthttp.RequestCtx) {
	args := ctx.QueryArgs()
	q := stats.Query{Window: string(args.Peek("window")), Route: string(args.Peek("route")), Model: string(args.Peek("model")),
		Tenant: string(args.Peek("tenant")), Upstream: string(args.Peek("upstream")), Class: string(args.Peek("class"))}
	if g := string(args.Peek("group_by")); g != "" {
		q.GroupBy = strings.Split(g, ",")
	}
	ctx.SetContentType("application/json")
	if cmp := string(args.Peek("compare")); cmp != "" {
		ua, ub, ok := strings.Cut(cmp, ",")
		var sides string
		if cmp == "auto" && q.Route != "" {
			// The one rule every view follows (Proxy.CompareSides).
			ua, ub, sides, ok = a.p.CompareSides(q.Route)
			if !ok {
				ctx.SetStatusCode(fasthttp.StatusNotFound)
				writeJSON(ctx, map[string]any{"error": "route " + q.Route + " has no two upstreams to compare"})
				return
			}
		}
		switch {
		case !ok || ua == "" || ub == "" || q.Route == "":
			ctx.SetStatusCode(fasthttp.StatusBadRequest)
			ctx.SetBodyString(`{"error":"compare takes two upstreams, compare=A,B, or compare=auto, with route=R"}` + "\n")
			return
		case !stats.ValidWindow(q.Window):
			ctx.SetStatusCode(fasthttp.StatusBadRequest)
			ctx.SetBodyString(`{"error":"window must be 1m, 5m, 15m, 1h or all"}` + "\n")
			return
		}
		c, err := a.p.Stats().CompareClass(q.Route, ua, ub, q.Window, q.Class)
		c.Sides = sides
		if err != nil {
			ctx.SetStatusCode(fasthttp.StatusNotFound)
			writeJSON(ctx, map[string]any{"error": err.Error(), "a": ua, "b": ub, "sides": sides, "count_a": c.CountA, "count_b": c.CountB})
			return
		}
		writeJSON(ctx, c)
		return
	}
	switch {
	case !stats.ValidWindow(q.Window):
		ctx.SetStatusCode(fasthttp.StatusBadRequest)
		ctx.SetBodyString(`{"error":"window must be 1m, 5m, 15m, 1h or all"}` + "\n")
		return
	case !stats.ValidGroupBy(q.GroupBy):
		ctx.SetStatusCode(fasthttp.StatusBadRequest)
		ctx.SetBodyString(`{"error":"group_by takes route, model, tenant, upstream and class, comma separated"}` + "\n")
		return
	}
	if string(args.Peek("format")) == "sketch" {
		writeJSON(ctx, a.p.Stats().QuerySketches(q))
		return
	}
	rep := a.p.Stats().Query(q)
	for _, g := range a.p.Guards() {
		if q.Route == "" || q.Route == g.Route {
			rep.Guards = append(rep.Guards, g)
			rep.Warnings = append(rep.Warnings, stats.GuardWarning(g))
		}
	}
	for _, o := range a.p.Overload() {
		if (q.Route == "" || q.Route == o.Route) && (q.Upstream == "" || q.Upstream == o.Upstream) {
			rep.Overload = append(rep.Overload, o)
			if o.Shedding {
				rep.Warnings = append(rep.Warnings, stats.OverloadWarning(o))
			}
		}
	}
	writeJSON(ctx, rep)
}

func writeJSON(ctx *fasthttp.RequestCtx, v any) {
	enc := json.NewEncoder(ctx)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		ctx.SetStatusCode(fasthttp.StatusInternalServerError)
	}
}

// authorized checks the bearer token in constant time.
func (a *admin) authorized(ctx *fasthttp.RequestCtx) bool {
	tok := a.token.Load()
	if tok == nil || *tok == "" {
		return true
	}
	got := ctx.Request.Header.Peek("Authorization")
	const scheme = "Bearer "
	if len(got) <= len(scheme) || string(got[:len(scheme)]) != scheme {
		return false
	}
	return subtle.ConstantTimeCompare(got[len(scheme):], []byte(*tok)) == 1
}
