// Package proxy is tokentap's relay: a fasthttp handler that forwards every
// request to the upstream of its route, relays the response byte for byte
// (streams chunk by chunk, flushed as they arrive), and measures on the way
// what the client experienced, one metrics.Record per request.
//
//	p, err := proxy.New(cfg, proxy.Options{Sinks: []metrics.Sink{accessLog}})
//	ln, err := p.Listen(":8080")
//	go p.Serve(ln)
//	...
//	p.Shutdown(ctx)             // drain; p.Cut(wait) for what outlives ctx
//	...
//	p.Close()
//
// The journey of one request (docs/ARCHITECTURE.md draws it): ServeHTTP
// begins the exchange (arrival: when the kernel received the request's
// first bytes; the request id) and runs its steps in order (serve.go):
// route (method, framing, normalised path, longest-prefix route on segment
// boundaries, dialect, tenant from the key), readRequest (the body in
// bounded pieces, the model), the upstream's choice, overload and
// admission (steer.go), forward (the upstream request on a checked pooled
// connection, up to the response headers: forward.go), relay (headers
// out; the body then goes through the exchange's relay.Body, one upstream
// read per chunk, measured by its measure.Tap on the way). A step that
// refuses returns a refusal, which refuse answers and records: the one
// place that does. The record is finished exactly once, in finish.go.
//
// Each concern is a package of its own under proxy/, below this one:
// downstream (the client's connection), upstream (the backends), routing,
// admission, measure and relay, over internal/sock and
// internal/relayplane. The exchange (exchange.go) is the one type that
// knows them all.
package proxy

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"net"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/admission"
	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/tokentap/tokentap/proxy/internal/relayplane"
	"github.com/tokentap/tokentap/proxy/measure"
	"github.com/tokentap/tokentap/proxy/relay"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/tokentap/tokentap/ratelimit"
	"github.com/tokentap/tokentap/sse/dialect"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"
)

// Proxy is the relay. It is safe for concurrent use; its configuration can
// be swapped with Apply while requests are in flight.
type Proxy struct {
	opts    Options
	now     func() time.Time
	log     *zap.Logger
	snap    atomic.Pointer[snapshot]
	applyMu sync.Mutex // one Apply at a time
	// keepAliveValue is the Keep-Alive header responses carry (nil: an
	// idle timeout under a second, not said).
	keepAliveValue []byte
	// pools are the connection pools of the configuration in use, by
	// poolKey: the next configuration takes over those it reaches the same
	// way and retires the others. Guarded by applyMu.
	pools map[string]*upstream.Pool

	srvMu sync.Mutex
	srv   *fasthttp.Server              // made by the first Serve
	h2    atomic.Pointer[downstream.H2] // the HTTP/2 connections' server: made by Serve, again after a Shutdown
	// resumed counts, per connection, the goroutines serving it again
	// after a response tokentap wrote itself (resume); stopping is set by
	// Shutdown, from when no connection is given back. Under srvMu.
	resumed  map[*downstream.Conn]int
	stopping atomic.Bool

	caps     *downstream.Caps // client connections opened through Listen
	inflight atomic.Int64     // exchanges begun and not finished
	bodies   atomic.Int64     // request body bytes held (Options.MaxBufferedBodies)
	cutting  atomic.Bool      // Cut was called: what ends now was cut
	idPrefix [8]byte
	idSeq    atomic.Uint64
	pool     sync.Pool         // *exchange
	infos    sync.Pool         // *sock.TCPInfo: the readings at a response's end (takeInfo)
	waiting  measure.LookWatch // records waiting for the client's acknowledgement (exchange.awaitAck)
	// clientAcks watches the clients' acknowledgements of the first
	// tokens' bytes, with the floors of their paths' round trips.
	clientAcks measure.Acks
	loops      relayplane.Set // the relay loops: started by Serve, stopped by Shutdown and Close
	stats      *stats.Engine
	statsNow   func() time.Time
	monitor    *downstream.MonitorTick // the runtime's monitor kept awake while requests are in flight
	// relays is the server as every response's relay sees it (its clock,
	// its loops, its stopping, and the connection given back).
	relays relay.Server
}

// New builds a Proxy for cfg.
func New(cfg Config, opts Options) (*Proxy, error) {
	opts = opts.withDefaults()
	p := &Proxy{opts: opts, now: opts.Now, log: opts.Logger.Named("proxy"),
		caps: downstream.NewCaps(opts.MaxConns, opts.MaxConnsPerIP)}
	_, _ = rand.Read(p.idPrefix[:])
	p.monitor = downstream.NewMonitorTick(func() bool { return p.inflight.Load() > 0 })
	p.relays = relay.Server{Now: p.now, Stopping: &p.stopping, Resume: p.resume}
	if !opts.GoroutineRelay {
		p.relays.Loops = &p.loops
	}
	if s := int64(opts.IdleTimeout / time.Second); s > 0 {
		p.keepAliveValue = []byte("timeout=" + strconv.FormatInt(s, 10))
	}
	statsNow := opts.StatsNow
	if statsNow == nil {
		statsNow = opts.Now
	}
	p.stats, p.statsNow = stats.New(stats.Options{Now: statsNow}), statsNow
	if err := p.Apply(cfg); err != nil {
		return nil, err
	}
	return p, nil
}

// Apply validates cfg and swaps it in atomically. Requests in flight finish
// on the generation they started with.
func (p *Proxy) Apply(cfg Config) error {
	p.applyMu.Lock()
	defer p.applyMu.Unlock()
	if err := cfg.Validate(); err != nil {
		return err
	}
	for _, w := range cfg.Warnings() {
		p.log.Warn(w)
	}
	cfg = cfg.withDefaults()
	s := &snapshot{cfg: cfg, pools: map[string]*upstream.Pool{}}
	var rows []metrics.RouteRow
	for i, r := range cfg.Routes {
		rt, err := p.buildRoute(s, i, r, &rows)
		if err != nil {
			return err
		}
		s.routes = append(s.routes, rt)
	}
	sort.SliceStable(s.routes, func(i, j int) bool { return byModelOrder(s.routes[i], s.routes[j]) })
	var carry *metrics.Set
	if prev := p.snap.Load(); prev != nil {
		carry = prev.metrics
	}
	s.metrics = metrics.NewSet(rows, cfg.Models, metrics.SetOptions{Buckets: cfg.Buckets, SLO: cfg.hasSLO(), NoSeries: p.opts.NoSeries,
		PerRoute: cfg.ModelsPerRoute, Carry: carry})
	for _, rt := range s.routes {
		if _, candidate, ok := rt.set.GuardSides(); ok {
			set := rt.set
			s.metrics.AddGauge(fmt.Sprintf(`tokentap_guard_tripped{route=%q,upstream=%q}`, rt.Name, candidate), func() float64 {
				if set.Tripped() != nil {
					return 1
				}
				return 0
			})
		}
	}
	old := p.snap.Load()
	var prev *ratelimit.Admitter
	if old != nil {
		prev = old.admit
	}
	s.admit = admission.NewAdmitter(cfg.Admission, prev, p.now, s.metrics)
	if s.admit != nil {
		addr := s.admit.StoreAddr()
		s.admit.OnStoreChange(func(up bool, err error) {
			if up {
				p.log.Info("admission store answers again: limits are shared across replicas", zap.String("addr", addr))
			} else {
				p.log.Warn("admission store does not answer: deciding without it until a probe is answered",
					zap.String("addr", addr), zap.Error(err), zap.Bool("fail_open", s.admit.StoreStats().FailOpen))
			}
		})
	}
	s.observers = observersOf(p, s)
	s.metrics.Register()
	p.stats.SetWarn(cfg.Warn)
	p.stats.SetMaxGroups(cfg.StatsMaxGroups)
	if !p.opts.NoStats {
		st := p.stats
		s.metrics.AddGauge("tokentap_stats_groups", func() float64 { return float64(st.TableStats().Groups) })
		s.metrics.AddGauge("tokentap_stats_requests_folded", func() float64 { return float64(st.TableStats().Folded) })
		s.metrics.AddGauge("tokentap_stats_groups_evicted", func() float64 { return float64(st.TableStats().Evicted) })
	}
	pools := p.pools
	p.pools = s.pools
	if old := p.snap.Swap(s); old != nil {
		old.metrics.Unregister()
		old.scrapers(func(sc *routing.Scraper) { sc.Close() })
	}
	s.scrapers(func(sc *routing.Scraper) { go sc.Run() })
	for k, pool := range pools {
		if s.pools[k] != pool {
			pool.Retire()
		}
	}
	return nil
}

// buildRoute makes route i of a new generation: its upstreams (each a
// metric row, appended to rows), shadow and guard.
func (p *Proxy) buildRoute(s *snapshot, i int, r Route, rows *[]metrics.RouteRow) (*route, error) {
	rt := &route{Route: r, slo: s.cfg.SLO.Over(r.SLO), index: i, dialect: dialect.ByName(r.Dialect), prices: measure.RoutePrices(s.cfg.Prices, r.Models)}
	// Where tenants are known by the keys clients present, those keys are
	// tokentap's: they go no further unless the route says.
	rt.stripKey = s.cfg.Admission != nil && s.cfg.Admission.TrustedTenantHeader == "" && !r.ForwardClientKey
	specs := r.Upstreams
	if len(specs) == 0 {
		specs = []Upstream{{URL: r.Upstream, Weight: 1}} // no name: no upstream label
	}
	if r.TLS != nil && r.TLS.InsecureSkipVerify {
		p.log.Warn("upstream certificates are not verified (tls.insecure_skip_verify)", zap.String("route", r.Name))
	}
	var members []*routing.Member
	for _, u := range specs {
		up, err := upstream.New(u.URL, r.Timeouts, p.now, r.TLS)
		if err == nil && u.Protocol == upstream.ProtocolH2C {
			err = up.UseH2C()
		}
		if err != nil {
			return nil, fmt.Errorf("routes[%d].upstream: %w", i, err)
		}
		up.SetHeaders(upstream.MergeHeaders(r.Headers, u.Headers))
		// The connections of an earlier configuration's upstream that
		// reaches the backend the same way carry on, with their count.
		k := r.Name + "|" + u.Name + "|" + up.PoolKey(r.TLS)
		if pool := p.pools[k]; pool != nil {
			up.UsePool(pool)
		}
		s.pools[k] = up.Pool
		mem := &routing.Member{Name: u.Name, Up: up, Weight: u.Weight, Row: len(*rows)}
		if u.MetricsURL != "" {
			mem.Scrape = routing.NewScraper(u.MetricsURL, p.now)
		}
		members = append(members, mem)
		*rows = append(*rows, metrics.RouteRow{Route: r.Name, Upstream: u.Name, Models: routing.LiteralModels(r.Models)})
	}
	rt.set = routing.NewSet(members, routing.Options{Route: r.Name, Balance: r.Balance, Sticky: r.Sticky, Models: len(r.Models) > 0,
		Guard: r.Guard}, p.statsNow())
	if r.Shadow != nil {
		sh := &shadowState{Shadow: r.Shadow.withDefaults()}
		sh.member = rt.set.Member(sh.Upstream)
		rt.shadow = sh
	}
	return rt, nil
}

// Stats returns the live percentile table of every request the proxy
// finished, across reloads.
func (p *Proxy) Stats() *stats.Engine { return p.stats }

// StatsOff says the live /stats table is off (Options.NoStats): the engine
// is fed nothing.
func (p *Proxy) StatsOff() bool { return p.opts.NoStats }

// ClientConns returns the number of open client connections accepted
// through Listen.
func (p *Proxy) ClientConns() int { return p.caps.Count() }

// InFlight returns the number of requests begun and not yet finished
// (recorded).
func (p *Proxy) InFlight() int { return int(p.inflight.Load()) }

// Cut ends a drain that ran out of time: it closes every client connection
// accepted through Listen, which cancels their requests upstream, and
// records each of them with outcome shutdown. It then waits, up to wait,
// for their records to be written, and reports whether all were.
func (p *Proxy) Cut(wait time.Duration) bool {
	p.cutting.Store(true)
	p.caps.CloseAll()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	return p.awaitRecorded(ctx) == nil
}

// awaitRecorded waits until every request begun has its record, or ctx is
// done.
func (p *Proxy) awaitRecorded(ctx context.Context) error {
	for p.inflight.Load() > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// Close stops the relay loops (a stream still in one ends as a failed
// write), releases idle upstream connections and unregisters metrics.
func (p *Proxy) Close() {
	p.loops.Stop()
	if s := p.snap.Load(); s != nil {
		if s.admit != nil {
			s.admit.Close()
		}
		s.metrics.Unregister()
		s.scrapers(func(sc *routing.Scraper) { sc.Close() })
		for _, r := range s.routes {
			r.set.CloseIdle()
		}
	}
}

// Shutdown stops accepting, closes idle client connections and waits for
// the requests in flight, and their records, until ctx is done (then see
// Cut), then stops the relay loops. A record can outlive its response: it waits for the client's
// acknowledgement of the last bytes (at most 2 s) or for the side decoder.
func (p *Proxy) Shutdown(ctx context.Context) error {
	p.srvMu.Lock()
	srv := p.srv
	p.stopping.Store(true)
	p.srvMu.Unlock()
	if srv == nil {
		return nil
	}
	p.closeResumed(true)
	h2done := make(chan error, 1)
	go func() { h2done <- p.h2.Load().Shutdown(ctx) }() // GOAWAY: HTTP/2 clients open no new stream
	if err := srv.ShutdownWithContext(ctx); err != nil {
		return err
	}
	if err := p.awaitRecorded(ctx); err != nil {
		return err
	}
	p.closeResumed(false)
	if err := <-h2done; err != nil {
		return err
	}
	p.loops.Stop()
	return nil
}

// resume serves the next requests of a connection the server handed over
// for a response tokentap wrote itself (relay.Body.ServePass), once that
// response ended: the server takes it back as it takes a new connection,
// unless the proxy is shutting down.
func (p *Proxy) resume(cc *downstream.Conn) {
	cc.Resume() // once the goroutine that served it has let go of it
	p.srvMu.Lock()
	srv := p.srv
	if srv == nil || p.stopping.Load() {
		p.srvMu.Unlock()
		_ = cc.Close()
		return
	}
	if p.resumed == nil {
		p.resumed = map[*downstream.Conn]int{}
	}
	p.resumed[cc]++
	p.srvMu.Unlock()
	_ = srv.ServeConn(cc) // it closes cc, unless a response hands it over again
	p.srvMu.Lock()
	if p.resumed[cc]--; p.resumed[cc] <= 0 {
		delete(p.resumed, cc)
	}
	p.srvMu.Unlock()
}

// closeResumed closes the connections given back to the server after a
// response tokentap wrote (resume): with idle, those that have not begun
// a next request (the server would wait up to 5 s for them, as for any
// connection it was just given); else all that remain, once the server
// stopped (one given back just as the shutdown began is not among those
// it waits for).
func (p *Proxy) closeResumed(idle bool) {
	p.srvMu.Lock()
	conns := make([]*downstream.Conn, 0, len(p.resumed))
	for c := range p.resumed {
		if !idle || c.ClaimIdle() {
			conns = append(conns, c)
		}
	}
	p.srvMu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
}

// keepAliveGrace is how much longer than the Keep-Alive timeout it
// advertises the server keeps an idle connection open.
const keepAliveGrace = time.Second

// idleWait is how long the server waits for the next request on a
// kept-alive connection: the advertised timeout and the grace.
func (p *Proxy) idleWait() time.Duration { return p.opts.IdleTimeout + keepAliveGrace }

// keepAlive tells a client that may keep its connection how long it stays
// open while idle (Keep-Alive: timeout=N, whole seconds, as RFC 9112's
// predecessors and nginx's keepalive_timeout give it).
func (p *Proxy) keepAlive(ctx *fasthttp.RequestCtx) {
	if p.keepAliveValue == nil || ctx.Response.ConnectionClose() || ctx.Request.Header.ConnectionClose() {
		return
	}
	ctx.Response.Header.SetBytesV("Keep-Alive", p.keepAliveValue)
}

// Listen opens a TCP listener for Serve: its connections bound every write
// with the client write timeout, carry the kernel's receive times, and
// count under the connection caps; its Accept survives transient errors.
func (p *Proxy) Listen(addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	return p.wrap(ln), nil
}

// ListenTLS is Listen with TLS on every connection, by cfg (its
// GetCertificate or GetConfigForClient can serve renewed certificates).
// Measurement is the same as on plain connections: the kernel's receive
// stamps and TCP_INFO of the socket under the TLS layer. The responses are
// written by the server: tokentap's own writes of streams (on a hijacked
// connection, on the relay loops) are for plain connections.
func (p *Proxy) ListenTLS(addr string, cfg *tls.Config) (net.Listener, error) {
	l, err := p.Listen(addr)
	if err != nil {
		return nil, err
	}
	cfg = cfg.Clone()
	if len(cfg.NextProtos) == 0 {
		cfg.NextProtos = []string{"h2", "http/1.1"}
	}
	l.(*downstream.Listener).ServeTLS(cfg)
	return l, nil
}

func (p *Proxy) wrap(ln net.Listener) *downstream.Listener {
	return downstream.NewListener(ln, downstream.ListenerOptions{WriteTimeout: p.opts.ClientWriteTimeout, IdleWait: p.idleWait(),
		ReadTimeout: p.opts.RequestReadTimeout, Caps: p.caps, Log: p.log})
}

// A listener's TLS from its files, reloaded without a restart
// (proxy/downstream).
type (
	ServerTLS      = downstream.ServerTLS
	ServerTLSFiles = downstream.ServerTLSFiles
)

// NewServerTLS reads a listener's TLS files (downstream.NewServerTLS).
func NewServerTLS(f ServerTLSFiles) (*ServerTLS, error) { return downstream.NewServerTLS(f) }

// LoadServerTLS reads and checks a listener's TLS files, for a config's
// validation (downstream.LoadServerTLS).
func LoadServerTLS(f ServerTLSFiles) (*tls.Config, error) { return downstream.LoadServerTLS(f) }

// WatchFiles calls changed whenever the files paths() names change
// (downstream.WatchFiles).
func WatchFiles(ctx context.Context, every time.Duration, paths func() []string, changed func()) {
	downstream.WatchFiles(ctx, every, paths, changed)
}

// AnswerPlainHTTP answers a plain HTTP request made to a TLS port
// (downstream.AnswerPlainHTTP); the admin listener's error handler calls
// it too.
func AnswerPlainHTTP(err error) bool { return downstream.AnswerPlainHTTP(err) }

// zapPrintf takes fasthttp's own log lines. Only their format string is
// logged: the arguments can carry a request's bytes (headers, keys) and
// addresses.
type zapPrintf struct{ l *zap.Logger }

// ServerLogger is a fasthttp.Logger that keeps only the format of
// fasthttp's own lines, at debug level on l: their arguments can hold a
// client's request bytes (header values), which never reach a log.
func ServerLogger(l *zap.Logger) fasthttp.Logger { return zapPrintf{l} }

func (z zapPrintf) Printf(format string, args ...any) {
	if ce := z.l.Check(zap.DebugLevel, "fasthttp"); ce != nil {
		ce.Write(zap.String("format", format))
	}
}

// newRequestID returns a unique id: a random process prefix and a counter.
func (p *Proxy) newRequestID(dst []byte) []byte {
	var b [16]byte
	copy(b[:8], p.idPrefix[:])
	n := p.idSeq.Add(1)
	for i := 0; i < 8; i++ {
		b[15-i] = byte(n >> (8 * i))
	}
	return hex.AppendEncode(dst, b[:])
}
