package main

// Routing mode Auto, decided here per request: P/D or local prefill on decode, from the view of
// Auto mode's model the Python gateway pushes in the routing table (policy.AutoView: settings,
// SLO budgets, what the handoffs taught it) and the engines' queues as they are now (its scraped
// view plus this data plane's own requests in flight). decideAuto is policy.decide_with, rule
// for rule; testdata/auto_decision_cases.json holds both to the same answers. What the requests
// served here teach (handoff and prefill times, answers' lengths, which request measures the
// first handoff) is reported back on GET /stats, and the Python gateway learns from it.

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

const routeAuto = "auto" // P/D or local prefill, decided per request (decideAuto)

// autoView is policy.AutoView as the Python gateway writes it (AutoView.to_wire).
type autoView struct {
	ShortPromptTokens      int64              `json:"shortPromptTokens"`
	LocalWhenDecodeIdle    bool               `json:"localWhenDecodeIdle"`
	PDTTFTShare            float64            `json:"pdTtftShare"`
	ITLShare               float64            `json:"itlShare"`
	TTFTBudget             *float64           `json:"ttftBudget"`
	ITLBudget              *float64           `json:"itlBudget"`
	Degraded               bool               `json:"degraded"`
	Learning               *bool              `json:"learning"` // nil: measured or not needed
	SecondsPerToken        *float64           `json:"secondsPerToken"`
	ByPrefill              map[string]float64 `json:"byPrefill"`
	PrefillSecondsPerToken *float64           `json:"prefillSecondsPerToken"`
	OutputTokens           *float64           `json:"outputTokens"`
}

// queueState is policy.QueueState: the engines' queues one decision reads.
type queueState struct {
	DecodeActive      *float64           `json:"decodeActive"`
	PrefillAhead      *float64           `json:"prefillAhead"`
	PrefillAheadBy    map[string]float64 `json:"prefillAheadBy"`
	DecodeStepSeconds *float64           `json:"decodeStepSeconds"`
	PrefillBacklogBy  map[string]float64 `json:"prefillBacklogBy"`
}

// autoDecision is policy.Decision.
type autoDecision struct {
	Disaggregated bool     `json:"disaggregated"`
	Reason        string   `json:"reason"`
	Anywhere      bool     `json:"anywhere"` // local, and it may run whole on a prefill replica
	Prefill       []string `json:"prefill"`  // P/D only through these prefill servers; empty: any
}

// predictedHandoff: through `prefill` ("" for none) when its estimate is pushed, else what all
// handoffs said; ok false when nothing is known.
func (v *autoView) predictedHandoff(tokens int64, prefill string) (float64, bool) {
	perToken, ok := v.ByPrefill[prefill]
	if prefill == "" || !ok {
		if v.SecondsPerToken == nil {
			return 0, false
		}
		perToken = *v.SecondsPerToken
	}
	return perToken * float64(tokens), true
}

// slowPath: why P/D through this prefill replica would miss the TTFT budget on its KV path
// alone ("" when it would not).
func (v *autoView) slowPath(tokens int64, prefill string) string {
	if v.TTFTBudget == nil {
		return ""
	}
	budget := *v.TTFTBudget
	handoff, known := v.predictedHandoff(tokens, prefill)
	if known && handoff > budget {
		return "handoff_over_ttft_budget"
	}
	if v.PrefillSecondsPerToken != nil {
		thisPrefill := *v.PrefillSecondsPerToken * float64(tokens)
		if thisPrefill <= budget && thisPrefill+handoff > v.PDTTFTShare*budget {
			return "kv_path_over_ttft_budget" // even an idle prefill pool would miss the SLO
		}
	}
	return ""
}

// localBreaksITL: prefilling this prompt on the least busy decode replica would push its
// streams' time between tokens over the ITL budget.
func (v *autoView) localBreaksITL(thisPrefill float64, q *queueState) bool {
	if v.ITLBudget == nil || q.DecodeActive == nil || *q.DecodeActive == 0 ||
		q.DecodeStepSeconds == nil || v.OutputTokens == nil {
		return false
	}
	return *q.DecodeStepSeconds+thisPrefill/math.Max(1, *v.OutputTokens) > v.ITLShare**v.ITLBudget
}

// decideAuto is policy.decide_with: P/D or local prefill for one request. `promptTokens` nil:
// not known. `probe` is asked once per request eligible for P/D while the path is degraded.
func decideAuto(v *autoView, promptTokens *int64, prefillAvailable bool, q *queueState,
	replicas []string, probe func() bool) autoDecision {
	if !prefillAvailable {
		return autoDecision{Reason: "no_prefill"}
	}
	if promptTokens != nil && *promptTokens < v.ShortPromptTokens {
		return autoDecision{Reason: "short_prompt"}
	}
	if v.Degraded {
		if probe() {
			return autoDecision{Disaggregated: true, Reason: "probe"}
		}
		return autoDecision{Reason: "degraded", Anywhere: true}
	}
	if v.LocalWhenDecodeIdle && q.DecodeActive != nil && *q.DecodeActive == 0 {
		return autoDecision{Reason: "decode_idle"}
	}
	if v.Learning != nil && *v.Learning {
		return autoDecision{Reason: "handoff_unknown", Anywhere: true}
	}
	var tokens int64
	if promptTokens != nil {
		tokens = *promptTokens
	}
	candidates := replicas
	if len(candidates) == 0 {
		candidates = []string{""} // none named: the pool as a whole
	}
	only := func(usable []string) []string {
		if len(usable) == len(candidates) {
			return nil
		}
		out := []string{}
		for _, r := range usable {
			if r != "" {
				out = append(out, r)
			}
		}
		return out
	}
	usable := []string{}
	bestHandoff, bestWhy := math.Inf(1), ""
	for _, r := range candidates {
		why := v.slowPath(tokens, r)
		if why == "" {
			usable = append(usable, r)
			continue
		}
		if handoff, _ := v.predictedHandoff(tokens, r); handoff < bestHandoff {
			bestHandoff, bestWhy = handoff, why
		}
	}
	if len(usable) == 0 {
		// Every replica's path is too slow: say why for the one that is least so.
		return autoDecision{Reason: bestWhy, Anywhere: true}
	}
	if v.TTFTBudget != nil && v.PrefillSecondsPerToken != nil {
		speed := *v.PrefillSecondsPerToken
		thisPrefill := speed * float64(tokens)
		target := v.PDTTFTShare * *v.TTFTBudget
		if thisPrefill <= target {
			// Local prefill would fit: P/D must be predicted to fit too, through a replica
			// whose queue leaves room (the larger of two guesses at the wait ahead: the
			// requests there taken as long as this one, the prompt tokens waiting there).
			predicted := func(replica string) float64 {
				ahead, backlog := 0.0, 0.0
				if q.PrefillAhead != nil {
					ahead = *q.PrefillAhead
				}
				if replica != "" {
					if by, ok := q.PrefillAheadBy[replica]; ok {
						ahead = by
					}
					backlog = q.PrefillBacklogBy[replica]
				}
				handoff, _ := v.predictedHandoff(tokens, replica)
				return math.Max(ahead*thisPrefill, backlog*speed) + thisPrefill + handoff
			}
			fitting := []string{}
			for _, r := range usable {
				if predicted(r) <= target {
					fitting = append(fitting, r)
				}
			}
			if len(fitting) == 0 && v.localBreaksITL(thisPrefill, q) {
				return autoDecision{Disaggregated: true, Reason: "local_would_break_itl", Prefill: only(usable)}
			}
			if len(fitting) == 0 {
				// Congestion, not the path: spill to decode, not onto the busy prefill pool.
				return autoDecision{Reason: "prefill_queue_over_ttft_budget"}
			}
			usable = fitting
		}
	}
	return autoDecision{Disaggregated: true, Reason: "long_prompt", Prefill: only(usable)}
}

// autoJSON: a model's Auto mode in the routing table.
type autoJSON struct {
	View                   autoView `json:"view"`
	ProbeEvery             int64    `json:"probeEvery"`
	LearningTimeoutSeconds float64  `json:"learningTimeoutSeconds"`
	LocalOnPrefillPool     bool     `json:"localOnPrefillPool"`
	// Per routing target (a server, or one rank of it), its scraped queue.
	Queues map[string]engineQueue `json:"queues"`
	// Long prompts waiting in the peers' admission queues (this replica's own are counted here).
	Queued float64 `json:"queued"`
	// The step meter's window (settings.step_window_seconds).
	StepWindowSeconds float64 `json:"stepWindowSeconds"`
}

// stepMeter is endpoints.StepMeter: the mean gap between an engine's streamed events over
// windows, smoothed across windows, measured on the streams this data plane relays.
type stepMeter struct {
	mu      sync.Mutex
	seconds float64 // 0 until a window closed
	sum     time.Duration
	count   int
	started time.Time
}

func (m *stepMeter) observe(gap time.Duration, now time.Time, window time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.started.IsZero() || now.Sub(m.started) > 2*window {
		m.started, m.sum, m.count = now, 0, 0 // after a quiet spell: anew
	}
	m.sum += gap
	m.count++
	if now.Sub(m.started) >= window {
		mean := m.sum.Seconds() / float64(m.count)
		if m.seconds == 0 {
			m.seconds = mean
		} else {
			m.seconds = 0.5*mean + 0.5*m.seconds
		}
		m.started, m.sum, m.count = now, 0, 0
	}
}

// read: the smoothed step time; false before a window closed.
func (m *stepMeter) read() (float64, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.seconds, m.seconds > 0
}

// engineQueue: one engine's (or rank's) queue as the Python gateway last scraped it.
type engineQueue struct {
	Waiting     float64  `json:"waiting"`
	Running     float64  `json:"running"`
	Backlog     float64  `json:"backlog"`     // prompt tokens the Python gateway sent, not prefilled yet
	StepSeconds *float64 `json:"stepSeconds"` // recent time between its streams' tokens
}

// active: requests running or waiting there, this data plane's own in flight when they are
// ahead of the last scrape (planner.queue_state).
func (a *autoJSON) active(e *endpoint) float64 {
	q := a.Queues[e.key]
	return q.Waiting + math.Max(q.Running, float64(e.inflight.Load()))
}

// queues: planner.queue_state over the model's engines now; `queuedHere` long prompts wait in
// this replica's own admission queue, shared among the prefill servers with the peers'.
func (a *autoJSON) queues(m *model, queuedHere int) (*queueState, []string) {
	out := &queueState{PrefillAheadBy: map[string]float64{}, PrefillBacklogBy: map[string]float64{}}
	replicas := []string{}
	for i := range m.groups {
		for _, e := range m.groups[i].prefill {
			if !slices.Contains(replicas, e.url) {
				replicas = append(replicas, e.url)
			}
		}
	}
	queued := (a.Queued + float64(queuedHere)) / math.Max(1, float64(len(replicas)))
	var calmest *endpoint
	calm := math.Inf(1)
	for i := range m.groups {
		for _, e := range m.groups[i].decode {
			if active := a.active(e); active < calm {
				calmest, calm = e, active
			}
		}
		for _, e := range m.groups[i].prefill {
			// The prompt tokens waiting there: the Python gateway's and this data plane's own.
			ahead, backlog := a.active(e)+queued, a.Queues[e.key].Backlog+float64(e.backlog.Load())
			if before, ok := out.PrefillAheadBy[e.url]; ok { // its calmest rank
				ahead, backlog = math.Min(before, ahead), math.Min(out.PrefillBacklogBy[e.url], backlog)
			}
			out.PrefillAheadBy[e.url], out.PrefillBacklogBy[e.url] = ahead, backlog
			if out.PrefillAhead == nil || ahead < *out.PrefillAhead {
				out.PrefillAhead = &ahead
			}
		}
	}
	if calmest != nil {
		// Its streams as this data plane relays them; else as the Python gateway relayed them.
		out.DecodeActive, out.DecodeStepSeconds = &calm, a.Queues[calmest.key].StepSeconds
		if seconds, known := calmest.steps.read(); known {
			out.DecodeStepSeconds = &seconds
		}
	}
	return out, replicas
}

// autoRuntime: what Auto mode keeps between requests here, across routing tables, and what
// it reports to the Python gateway.
type autoRuntime struct {
	eligible       atomic.Int64 // requests eligible for P/D while degraded (every probeEvery-th probes)
	learningSince  atomic.Int64 // unix nanoseconds a request went to measure the first handoff; 0: none
	learningStarts atomic.Int64
	decisions      sync.Map // reason -> *atomic.Int64
	mu             sync.Mutex
	seq            int64
	ring           [observationRing]observation
}

// observationRing bounds what waits for the Python gateway's next stats poll (each second):
// the learning is averages, and a lost sample under a burst only slows it.
const observationRing = 1024

// observation: one thing a request taught Auto mode, numbered for the Python gateway to fold
// each once (policy.HandoffHealth and AutoPolicy.observe_output).
type observation struct {
	Seq     int64   `json:"seq"`
	Kind    string  `json:"kind"` // handoff, prefill, pdPrompt, output
	Seconds float64 `json:"seconds,omitempty"`
	Tokens  int64   `json:"tokens"`
	Prefill string  `json:"prefill,omitempty"` // the prefill server of a handoff
}

func (a *autoRuntime) observe(kind string, seconds float64, tokens int64, prefill string) {
	a.mu.Lock()
	a.seq++
	a.ring[a.seq%observationRing] = observation{a.seq, kind, seconds, tokens, prefill}
	a.mu.Unlock()
}

// decide: a request's decision, with the probe counted and the first handoff's measurement
// claimed here (the pushed view learns of both on the next push).
func (a *autoRuntime) decide(t *autoJSON, m *model, promptTokens int64, queuedHere int) autoDecision {
	q, replicas := t.queues(m, queuedHere)
	view := t.View
	learningOpen := view.Learning != nil && !*view.Learning
	if learningOpen {
		since := a.learningSince.Load()
		measuring := since != 0 && time.Since(time.Unix(0, since)).Seconds() < t.LearningTimeoutSeconds
		view.Learning = &measuring
		learningOpen = !measuring
	}
	probe := func() bool {
		return t.ProbeEvery > 0 && a.eligible.Add(1)%t.ProbeEvery == 0
	}
	d := decideAuto(&view, &promptTokens, len(replicas) > 0, q, replicas, probe)
	if learningOpen && d.Disaggregated {
		a.learningSince.Store(time.Now().UnixNano())
		a.learningStarts.Add(1)
	}
	counter, _ := a.decisions.LoadOrStore(d.Reason, new(atomic.Int64))
	counter.(*atomic.Int64).Add(1)
	return d
}

// snapshot: GET /stats's "auto": decisions by reason, how many requests went to measure the
// first handoff, and the observations still held past `after` (the last one the Python
// gateway folded).
func (a *autoRuntime) snapshot(after int64) map[string]any {
	a.mu.Lock()
	held := []observation{}
	for seq := max(1, a.seq-observationRing+1, after+1); seq <= a.seq; seq++ {
		held = append(held, a.ring[seq%observationRing])
	}
	a.mu.Unlock()
	return map[string]any{"decisions": snapshot(&a.decisions),
		"learningStarts": a.learningStarts.Load(), "observations": held}
}

// pickAuto: the engines for a decided request: P/D through the best allowed prefill replica
// and a decode replica that can pull its KV; local on the best decode replica, or of both
// pools when the P/D path itself is unusable (policy.Decision.anywhere); best as pick says.
func (m *model) pickAuto(d autoDecision, anywhere bool, w *placing) (prefill, decode *endpoint) {
	if d.Disaggregated {
		allowed := m.prefills
		if len(d.Prefill) > 0 {
			allowed = nil
			for _, e := range m.prefills {
				if slices.Contains(d.Prefill, e.url) {
					allowed = append(allowed, e)
				}
			}
		}
		if prefill = w.pick("prefill", allowed, true); prefill != nil {
			return prefill, m.decodeFor(prefill, w)
		}
	}
	pool := m.decodes
	if d.Anywhere && anywhere { // Placement.decode_candidates: the decode pool, then prefill's
		pool = append(append(make([]*endpoint, 0, len(m.decodes)+len(m.prefills)), m.decodes...), m.prefills...)
	}
	return nil, w.pick("decode", pool, true)
}
