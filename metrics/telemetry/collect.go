package telemetry

import (
	"context"
	"slices"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/sdk/instrumentation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.opentelemetry.io/otel/sdk/resource"
)

// collect is the points as the exporter takes them at now: every point,
// from its start, for a cumulative exporter; for a delta one the points
// that moved since the last export, which then start again.
func (in *instruments) collect(res *resource.Resource, scope string, now time.Time) *metricdata.ResourceMetrics {
	temporality := metricdata.CumulativeTemporality
	if !in.cumulative {
		temporality = metricdata.DeltaTemporality
	}
	var ms []metricdata.Metrics
	for m := range metricDefs {
		d := &metricDefs[m]
		if !in.on[m] {
			continue
		}
		var hs []metricdata.HistogramDataPoint[float64]
		var cs []metricdata.DataPoint[int64]
		for _, ls := range in.sets {
			for s, p := range ls.points[m] {
				if p == nil || p.count == 0 {
					continue
				}
				start := p.start
				if !in.cumulative {
					start = in.since
				}
				if d.bounds == nil {
					cs = append(cs, metricdata.DataPoint[int64]{Attributes: ls.attrs[s], StartTime: start, Time: now, Value: p.total})
				} else {
					hs = append(hs, metricdata.HistogramDataPoint[float64]{Attributes: ls.attrs[s], StartTime: start, Time: now,
						Count: p.count, Bounds: d.bounds, BucketCounts: slices.Clone(p.buckets), Sum: p.sum,
						Min: metricdata.NewExtrema(p.min), Max: metricdata.NewExtrema(p.max)})
				}
				if !in.cumulative {
					clear(p.buckets)
					p.count, p.sum, p.total = 0, 0, 0
				}
			}
		}
		switch {
		case len(hs) > 0:
			ms = append(ms, metricdata.Metrics{Name: d.name, Description: d.desc, Unit: d.unit,
				Data: metricdata.Histogram[float64]{DataPoints: hs, Temporality: temporality}})
		case len(cs) > 0:
			ms = append(ms, metricdata.Metrics{Name: d.name, Description: d.desc, Unit: d.unit,
				Data: metricdata.Sum[int64]{DataPoints: cs, Temporality: temporality, IsMonotonic: true}})
		}
	}
	in.since = now
	return &metricdata.ResourceMetrics{Resource: res, ScopeMetrics: []metricdata.ScopeMetrics{{Scope: instrumentation.Scope{Name: scope}, Metrics: ms}}}
}

// metricSend exports the collected metrics every interval
// (OTEL_METRIC_EXPORT_INTERVAL, 60 s), within a timeout
// (OTEL_METRIC_EXPORT_TIMEOUT, 30 s), with the OTLP metric exporter, on a
// goroutine of its own: the exporter's goroutine collects and hands over,
// and skips an interval while the export before is still on its way
// (a cumulative point loses nothing by it; a delta one keeps adding up).
// Cancelled (Exporter.Shutdown), it gives up the export on its way and
// sends no more.
type metricSend struct {
	exp     sdkmetric.Exporter
	res     *resource.Resource
	scope   string
	timeout time.Duration
	stall   time.Duration // an export unanswered this long is told (watchStall)
	tick    *time.Ticker
	out     chan *metricdata.ResourceMetrics
	ctx     context.Context // cancelled by Shutdown
	cancel  context.CancelFunc
	done    chan struct{} // closed when the sender has returned
}

func newMetricSend(exp sdkmetric.Exporter, res *resource.Resource, scope string) *metricSend {
	m := &metricSend{exp: exp, res: res, scope: scope, timeout: envMillis("OTEL_METRIC_EXPORT_TIMEOUT", 30000),
		tick: time.NewTicker(envMillis("OTEL_METRIC_EXPORT_INTERVAL", 60000)),
		out:  make(chan *metricdata.ResourceMetrics, 1), done: make(chan struct{})}
	m.ctx, m.cancel = context.WithCancel(context.Background())
	go m.send()
	return m
}

// offer collects in's points and hands them over, unless an export is
// still waiting to go.
func (m *metricSend) offer(in *instruments) {
	if len(m.out) > 0 {
		return
	}
	m.out <- in.collect(m.res, m.scope, time.Now())
}

// close hands the last collection over, waiting for the sender to take it
// or for its cancel; the sender returns once it is exported.
func (m *metricSend) close(in *instruments) {
	m.tick.Stop()
	select {
	case m.out <- in.collect(m.res, m.scope, time.Now()):
	case <-m.ctx.Done():
	}
	close(m.out)
}

func (m *metricSend) send() {
	defer close(m.done)
	for {
		var rm *metricdata.ResourceMetrics
		select {
		case r, ok := <-m.out:
			if !ok {
				return
			}
			rm = r
		case <-m.ctx.Done():
			return
		}
		if len(rm.ScopeMetrics[0].Metrics) == 0 {
			continue
		}
		ctx, cancel := context.WithTimeout(m.ctx, m.timeout)
		stopWatch := watchStall("metrics", m.stall)
		if err := m.exp.Export(ctx, rm); err != nil {
			metrics.OTelExportError("metrics")
			otel.Handle(err)
		}
		stopWatch()
		cancel()
	}
}
