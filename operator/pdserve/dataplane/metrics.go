package main

// What the data plane served, measured as the Python gateway measures what it serves, so that
// its /metrics count every request whoever served it: requests by route and outcome, latency
// to the answer's end and to the first token, the gaps between streamed chunks, each render
// and derender call per render server (the render autoscaler's busy time), and the render,
// prefill and derender calls answered, by stage. Cumulative since
// start; the Python gateway reads them from /stats and adds them to its own series
// (pdserve/gateway/dataplane_metrics.py), with the bucket bounds it passed (-latency-buckets).

import (
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

type histogram struct {
	counts []atomic.Int64 // per bucket (not cumulative), the last one past every bound
	sum    atomic.Uint64  // float64 bits: the sum of the observations
}

// histograms are keyed by their label values (joined with a tab).
type histograms struct {
	bounds []float64 // seconds, ascending
	by     sync.Map  // key -> *histogram
}

func (h *histograms) observe(key string, d time.Duration) { h.observeValue(key, d.Seconds()) }

func (h *histograms) observeValue(key string, value float64) {
	found, ok := h.by.Load(key)
	if !ok {
		found, _ = h.by.LoadOrStore(key, &histogram{counts: make([]atomic.Int64, len(h.bounds)+1)})
	}
	each := found.(*histogram)
	bucket := sort.SearchFloat64s(h.bounds, value) // the first bound >= value: "le"
	each.counts[bucket].Add(1)
	for {
		old := each.sum.Load()
		if each.sum.CompareAndSwap(old, math.Float64bits(math.Float64frombits(old)+value)) {
			return
		}
	}
}

type histogramJSON struct {
	Labels []string `json:"labels"`
	Counts []int64  `json:"counts"`
	Sum    float64  `json:"sum"`
}

func (h *histograms) snapshot() []histogramJSON {
	out := []histogramJSON{}
	h.by.Range(func(key, value any) bool {
		each := value.(*histogram)
		counts := make([]int64, len(each.counts))
		for i := range each.counts {
			counts[i] = each.counts[i].Load()
		}
		labels := []string{} // a histogram without labels is observed under ""
		if key.(string) != "" {
			labels = strings.Split(key.(string), "\t")
		}
		out = append(out, histogramJSON{Labels: labels, Counts: counts,
			Sum: math.Float64frombits(each.sum.Load())})
		return true
	})
	return out
}

type servedMetrics struct {
	requests sync.Map // "route\toutcome" -> *atomic.Int64
	e2e      histograms
	ttft     histograms
	itl      histograms
	render   histograms // "render server URL\tstage"
	stage    histograms // render, prefill, decode_first_token (a rendered stream's), derender
	// A rendered stream's derender calls per choice, and the tokens merged into each (with
	// derender pipelining, those that arrived while the call before was in flight). No labels.
	derenderCalls  histograms
	derenderTokens histograms
}

// newServedMetrics: `latency` the bounds of the histograms of seconds, `counts` those of the
// derender counts.
func newServedMetrics(latency, counts []float64) *servedMetrics {
	return &servedMetrics{e2e: histograms{bounds: latency}, ttft: histograms{bounds: latency},
		itl: histograms{bounds: latency}, render: histograms{bounds: latency},
		stage: histograms{bounds: latency}, derenderCalls: histograms{bounds: counts},
		derenderTokens: histograms{bounds: counts}}
}

// parseBounds reads a buckets flag (`name`): ascending positive numbers, comma-separated.
func parseBounds(name, raw string) ([]float64, error) {
	bounds := []float64{}
	for _, field := range strings.Split(raw, ",") {
		value, err := strconv.ParseFloat(strings.TrimSpace(field), 64)
		if err != nil || value <= 0 || (len(bounds) > 0 && value <= bounds[len(bounds)-1]) {
			return nil, fmt.Errorf("-%s %q: expected ascending positive numbers, e.g. 0.005,0.01,0.1", name, raw)
		}
		bounds = append(bounds, value)
	}
	return bounds, nil
}

func (m *servedMetrics) count(route, outcome string) {
	key := route + "\t" + outcome
	found, ok := m.requests.Load(key)
	if !ok {
		found, _ = m.requests.LoadOrStore(key, new(atomic.Int64))
	}
	found.(*atomic.Int64).Add(1)
}

type requestCountJSON struct {
	Route   string `json:"route"`
	Outcome string `json:"outcome"`
	Count   int64  `json:"count"`
}

func (m *servedMetrics) snapshot() map[string]any {
	requests := []requestCountJSON{}
	m.requests.Range(func(key, value any) bool {
		route, outcome, _ := strings.Cut(key.(string), "\t")
		requests = append(requests, requestCountJSON{route, outcome, value.(*atomic.Int64).Load()})
		return true
	})
	return map[string]any{"requests": requests, "e2e": m.e2e.snapshot(), "ttft": m.ttft.snapshot(),
		"itl": m.itl.snapshot(), "renderCalls": m.render.snapshot(), "stages": m.stage.snapshot(),
		"derenderCalls": m.derenderCalls.snapshot(), "derenderTokens": m.derenderTokens.snapshot()}
}

// served is one request the data plane serves: its route is known once it is chosen, its
// outcome once it ends (ok unless a stream broke or the client left).
type served struct {
	id        string // the gateway's own id of the request, once engines may be called
	clientID  string // the client's X-Request-Id, echoed with the gateway's own
	metrics   *servedMetrics
	started   time.Time
	route     string
	outcome   string
	lastChunk time.Time // zero until the first token went out
	// Routing mode Auto: what this request teaches (nil in the other modes).
	learn         *autoRuntime
	promptTokens  int64     // as routing counted them: what prefill owes until it answers
	prefillDone   time.Time // when prefill answered with the KV's whereabouts
	prefillServer *endpoint // where that KV waits (to let it go when decode cannot be sent it)
	prefillOnly   []string  // Auto's P/D only through these prefill servers (admission, retries)
	stepWindow    time.Duration
	events        int64     // decode's events of a stream (one per engine step and choice)
	lastEvent     time.Time // zero until decode's first event
	log           *logged   // nil unless the request log is kept
	where         *placing  // what its engines are picked by, beside load (nil: load alone)
	kvToDecode    bool      // decode is sent prefill's KV: its own prefix cache is not filled
}

// event: decode sent a stream event; in routing mode Auto the gap since its last one feeds the
// engine's step meter (what a stream's time between tokens would be there now).
func (s *served) event(decode *endpoint) {
	if s.learn == nil {
		return
	}
	now := time.Now()
	if !s.lastEvent.IsZero() && s.stepWindow > 0 { // the window: Auto's alone
		decode.steps.observe(now.Sub(s.lastEvent), now, s.stepWindow)
	}
	s.lastEvent = now
	s.events++
}

// prefilled: prefill on `on` answered with the KV's whereabouts after `took`.
func (s *served) prefilled(on *endpoint, took time.Duration) {
	if s == nil {
		return
	}
	s.prefillDone, s.prefillServer = time.Now(), on
	if s.learn == nil {
		return
	}
	s.learn.observe("prefill", took.Seconds(), s.promptTokens, "")
	s.learn.observe("pdPrompt", 0, s.promptTokens, "")
}

// chunk: a piece of the answer went to the client (the first one is its first token).
func (s *served) chunk() {
	now := time.Now()
	if s.lastChunk.IsZero() {
		s.metrics.ttft.observe(s.route, now.Sub(s.started))
		if s.learn != nil && !s.prefillDone.IsZero() {
			// Prefill answered -> decode's first token: the KV pull plus one decode step.
			s.learn.observe("handoff", now.Sub(s.prefillDone).Seconds(), s.promptTokens, s.prefillServer.url)
		}
	} else {
		s.metrics.itl.observe(s.route, now.Sub(s.lastChunk))
		if s.log != nil {
			s.log.gaps = append(s.log.gaps, now.Sub(s.lastChunk))
		}
	}
	if s.log != nil && s.lastChunk.IsZero() {
		s.log.firstChunk = now
	}
	s.lastChunk = now
}

// answered: a whole (not streamed) answer went to the client: its first token too.
func (s *served) answered() {
	s.metrics.ttft.observe(s.route, time.Since(s.started))
}

// end counts the request; a request handed to the Python gateway is counted there instead.
func (s *served) end() {
	if s.route == "" {
		return
	}
	s.metrics.count(s.route, s.outcome)
	if s.learn != nil && s.events > 0 && s.outcome == "ok" {
		s.learn.observe("output", 0, s.events, "") // a whole streamed answer's length
	}
	s.metrics.e2e.observe(s.route, time.Since(s.started))
	// Logged as the Python gateway logs its own: an answer, a stream (whole or ended by an
	// error event), or a client that left once the engines had the request.
	if l := s.log; l != nil && s.id != "" && !l.failed {
		if line := l.line(s); line != nil {
			l.sink.record(line)
		}
	}
}

// ran: `stage` (render, prefill, decode) of the request ran on e: for the request log, and
// where its conversation and its prompt's prefix now are (placement.go).
func (s *served) ran(stage string, e *endpoint) {
	if stage != "render" {
		s.where.remember(stage, e, stage == "prefill" || !s.kvToDecode)
	}
	if s.log == nil || e == nil {
		return
	}
	switch stage {
	case "render":
		s.log.render = e.key
	case "prefill":
		s.log.prefill = e.key
	default:
		s.log.decode = e.key
	}
}
