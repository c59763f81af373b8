// pdserve's compiled data plane: the hot path of the P/D route (prefill with a remote-decode
// handoff, then decode, its answer or stream passed through; behind render servers, render
// first and derender last: render.go) in front of the
// Python gateway, which keeps every decision: it pushes the routing table (which engines,
// which route per model, the API keys' digests, the engines' load) and serves everything the
// table does not cover (a request an engine was sent is answered here, failed or not:
// failures.go).
//
//	pdserve-dataplane -listen 0.0.0.0:8000 -python http://127.0.0.1:8001 -control 127.0.0.1:8002
//
// Control API (loopback only, every call with Authorization: Bearer $PDSERVE_DATAPLANE_TOKEN:
// control.go): PUT /table replaces the routing table, GET /stats answers the counters the
// Python gateway folds into its own metrics, POST /drain closes each client connection after
// its answer from then on, GET /health.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/signal"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

type plane struct {
	current     atomic.Pointer[table]
	engines     map[string]*endpoint // guarded by tableMu
	tableMu     sync.Mutex
	upstream    *upstreamPool
	python      *httputil.ReverseProxy
	maxBody     int64
	inflight    atomic.Int64 // completions in flight, whichever path serves them
	maxInflight int64
	requireKeys bool // a table must carry API key digests: the gateway was started with keys
	stats       counters
	buffers     sync.Pool // *bytes.Buffer: bodies and answers
	chunks      sync.Pool // *[]byte: stream reads
	timeouts    timeouts
	admission   *admissionChannel
	queue       *fairQueue // this gateway replica's fair admission queue
	metrics     *servedMetrics
	auto        autoRuntime // routing mode Auto's state between requests
	requestLog  *requestLog // nil: the gateway keeps none
	intake      *intakeClient
	// conversation id -> its engines, per stage (placement.go)
	conversations conversations
	// Closed when the next routing table arrives (guarded by tableMu; nil: none made yet).
	tableMoved chan struct{}
	// Bidirectional KV (bidirectional.go): what decode holds per server, and per conversation
	// what its last turn left there.
	holds holdStore
	turns turnStore
}

// Every wait is bounded, as in the Python gateway (docs/gateway.md#timeouts); the first byte's
// bound is the upstream pool's.
type timeouts struct {
	idle, request, body time.Duration
	render              time.Duration // one render or derender call
}

type counters struct {
	pd, decode atomic.Int64 // requests served by route (streams among them)
	// served through render servers: render -> P/D -> derender, or render -> decode -> derender
	renderPD, renderDecode atomic.Int64
	streams                atomic.Int64
	fallbacks              sync.Map // reason -> *atomic.Int64: handed to the Python gateway
	// outcome -> *atomic.Int64: bidirectional KV's reuse decisions (bidirectional.go), and the
	// prompt tokens prefill was pointed to on decode
	reuse        sync.Map
	reusedTokens atomic.Int64
	// reason -> *atomic.Int64: served by local prefill on decode instead of P/D (the Python
	// gateway's pdserve_gateway_fallbacks_total, its reasons)
	localPrefills sync.Map
	// "stage/reason" -> *atomic.Int64: failed upstream calls that another may follow (the
	// Python gateway's pdserve_gateway_retries_total, its labels and its counting)
	retries sync.Map
	aborts  atomic.Int64 // aborts posted to tokens engines
	// long prompts admitted here because the leader's slot could not be asked for
	leaderErrors atomic.Int64
	unreadable   atomic.Int64
	intake       atomic.Int64 // requests the Python gateway's intake checked (intake.go)
}

func (c *counters) fallback(reason string) {
	value, _ := c.fallbacks.LoadOrStore(reason, new(atomic.Int64))
	value.(*atomic.Int64).Add(1)
}

func (c *counters) reused(outcome string) {
	value, _ := c.reuse.LoadOrStore(outcome, new(atomic.Int64))
	value.(*atomic.Int64).Add(1)
}

func (c *counters) localPrefill(reason string) {
	value, _ := c.localPrefills.LoadOrStore(reason, new(atomic.Int64))
	value.(*atomic.Int64).Add(1)
}

func (c *counters) retry(stage, reason string) {
	value, _ := c.retries.LoadOrStore(stage+"/"+reason, new(atomic.Int64))
	value.(*atomic.Int64).Add(1)
}

// streamRetried counts a decode stream that did not open as open_decode_stream does, by why;
// not one the client ended, nor one prefill's KV failed (a local-prefill fallback instead).
func (c *counters) streamRetried(f *failure) {
	switch {
	case f == nil || f.final || f.kv:
	case f.timedOut:
		c.retry("decode", "timeout")
	case f.answered != "":
		c.retry("decode", "upstream_error")
	default:
		c.retry("decode", "connect")
	}
}

func snapshot(counts *sync.Map) map[string]int64 {
	out := map[string]int64{}
	counts.Range(func(key, value any) bool {
		out[key.(string)] = value.(*atomic.Int64).Load()
		return true
	})
	return out
}

var handoff = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// What prefill must not see of the client's request: it answers one token, unstreamed.
var prefillDrops = map[string]bool{"stream": true, "max_tokens": true, "n": true,
	"max_completion_tokens": true, "stream_options": true, "min_tokens": true,
	"kv_transfer_params": true}
var decodeDrops = map[string]bool{"kv_transfer_params": true}

// fallback is why a request left the fast path; the Python gateway serves it.
type fallback string

func (p *plane) serveCompletion(w http.ResponseWriter, r *http.Request) {
	s := &served{metrics: p.metrics, started: time.Now(), outcome: "ok"}
	t := p.current.Load()
	// Which of two keys a check reads and which one an engine reads is anyone's guess: refused,
	// as the Python gateway refuses it.
	if len(r.Header.Values("Authorization")) > 1 {
		refuseBeforeBody(w, r, http.StatusBadRequest, "BadRequestError",
			"the request has more than one Authorization header; send one")
		return
	}
	// The key before the body, as the Python gateway checks it: a client without one gets its
	// 401 at once and holds nothing, not even the connection its upload would keep busy.
	if t != nil && !t.authorized(r.Header.Get("Authorization")) {
		unauthorized(w, r)
		return
	}
	if r.ContentLength > p.maxBody {
		p.refuseTooLarge(w, r) // before it would take a slot, its body unread
		return
	}
	buffer := p.buffers.Get().(*bytes.Buffer)
	buffer.Reset()
	defer p.buffers.Put(buffer)
	if err := p.receive(w, r, buffer); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			p.metrics.count("unknown", "error_408")
			bodyTimedOut(w, p.timeouts.body)
			return
		}
		// Nothing whole to hand over: the client's connection broke mid-body, or its chunked
		// framing did. Answered here, in the Python gateway's words.
		p.stats.unreadable.Add(1)
		answerError(w, http.StatusBadRequest, "BadRequestError", "request body could not be read "+
			"as sent: the connection or its chunked framing (Transfer-Encoding: chunked) broke", false)
		return
	}
	body := buffer.Bytes()
	if int64(len(body)) > p.maxBody {
		p.refuseTooLarge(w, r) // what is left of it dropped as it comes
		return
	}
	// One limit per gateway: a request holds its slot whether the data plane serves it or
	// hands it over (the Python gateway's own limit, the same number, is never reached).
	if n := p.inflight.Add(1); n > p.maxInflight {
		p.inflight.Add(-1)
		p.metrics.count("unknown", "rejected")
		atLimit(w, p.maxInflight)
		return
	}
	defer p.inflight.Add(-1)
	if t == nil {
		// The first routing table comes a moment after the start (the Python gateway pushes
		// it once the data plane listens): wait for it, then check the key as for any request.
		if t = p.firstTable(r.Context()); t == nil {
			p.metrics.count("unknown", "error_503")
			answerError(w, http.StatusServiceUnavailable, "ServiceUnavailableError",
				"the gateway is starting: retry shortly", false)
			return
		}
		if !t.authorized(r.Header.Get("Authorization")) {
			unauthorized(w, r)
			return
		}
	}
	if t.requestLog != nil && p.requestLog != nil {
		class := className(r.Header.Get("X-PDServe-Class"), r.URL.Path == "/v1/chat/completions")
		s.log = newLogged(p.requestLog, t.requestLog, class, r.Header.Get("X-Request-Id"))
	}
	// The request timeout runs from the request's start, as in the Python gateway.
	ctx, cancel := context.WithDeadline(r.Context(), s.started.Add(p.timeouts.request))
	defer cancel()
	reason := p.fast(ctx, w, r, t, body, s)
	switch {
	case reason == "":
		s.end()
	case r.Context().Err() != nil:
		s.outcome = "client_gone"
		s.end()
		// the client left: nobody to serve it to (the engines' work stopped with it)
	case ctx.Err() != nil && stages[reason] != "":
		// Its time is up: handed over, it would start again with all of it, the engines'
		// work done twice.
		p.metrics.count(s.route, "error_504")
		pastDeadline(w, stages[reason], p.timeouts.request)
	default:
		p.toPython(w, r, body, reason, s) // counted there
	}
}

// awaitEngines holds a request of model `name`, which has no complete set of engines, until a
// table gives it one, for the table's wait at most (the request's context ending first).
func (p *plane) awaitEngines(ctx context.Context, name string, t *table, m *model) (*table, *model) {
	timer := time.NewTimer(m.wait)
	defer timer.Stop()
	for {
		moved := p.nextTable()
		if now := p.current.Load(); now != t {
			if next := now.models[name]; next != nil {
				t, m = now, next
			}
		}
		if m.route != routeUnavailable {
			return t, m
		}
		select {
		case <-moved:
		case <-timer.C:
			return t, m
		case <-ctx.Done():
			return t, m
		}
	}
}

// firstTableWait bounds how long a request that arrived before the first routing table waits
// for it.
const firstTableWait = 10 * time.Second

// firstTable: the routing table, once the first one arrived (nil: none within firstTableWait,
// or the client left).
func (p *plane) firstTable(ctx context.Context) *table {
	timer := time.NewTimer(firstTableWait)
	defer timer.Stop()
	for {
		moved := p.nextTable()
		if t := p.current.Load(); t != nil {
			return t
		}
		select {
		case <-moved:
		case <-timer.C:
			return nil
		case <-ctx.Done():
			return nil
		}
	}
}

// nextTable: a channel closed when the next routing table arrives.
func (p *plane) nextTable() <-chan struct{} {
	p.tableMu.Lock()
	defer p.tableMu.Unlock()
	if p.tableMoved == nil {
		p.tableMoved = make(chan struct{})
	}
	return p.tableMoved
}

// receive reads the request body into `into` (at most maxBody+1 bytes) within the body
// timeout; os.ErrDeadlineExceeded when it did not arrive in time.
func (p *plane) receive(w http.ResponseWriter, r *http.Request, into *bytes.Buffer) error {
	if r.Body == nil || r.Body == http.NoBody {
		return nil
	}
	// A deadline on the connection (not a timer around the read): a client that stalls
	// mid-body is cut off however its bytes trickle in. Cleared once the body is read, or the
	// server's background read of the idle connection would take it for the client leaving;
	// kept when the read failed, so that Go's server does not wait to discard the rest of the
	// body before it closes the connection.
	control := http.NewResponseController(w)
	bounded := control.SetReadDeadline(time.Now().Add(p.timeouts.body)) == nil
	_, err := into.ReadFrom(io.LimitReader(r.Body, p.maxBody+1))
	if bounded && err == nil {
		_ = control.SetReadDeadline(time.Time{})
	}
	return err
}

// fast serves the request on the table's route, or says why it could not before answering.
func (p *plane) fast(ctx context.Context, w http.ResponseWriter, r *http.Request, t *table,
	body []byte, s *served) (reason fallback) {
	class := classAuto // any other value too: classed by the prompt's length (fairqueue.py)
	switch r.Header.Get("X-PDServe-Class") {
	case "document", "long":
		class = classLong
	case "chat", "short":
		class = classShort
	}
	members, err := topLevel(body)
	switch {
	case r.Header.Get("Content-Encoding") != "" || err != nil || duplicated(members):
		// The Python gateway's intake decodes it and reads it as the engines would, or says
		// why not.
		if body, members, reason = p.checked(ctx, w, r, body, s, "body_shape"); body == nil {
			return reason
		}
	case !provablyValid(r, body, members, r.URL.Path == "/v1/chat/completions"):
		// Not proven valid cheaply: the Python gateway's intake validates it.
		if body, members, reason = p.checked(ctx, w, r, body, s, "validation"); body == nil {
			return reason
		}
	}
	name := lookup(members, "model")
	if !plainString(name) {
		// No model (the served one is meant), or one spelt with escapes: the intake reads it.
		if body, members, reason = p.checked(ctx, w, r, body, s, "body_shape"); body == nil {
			return reason
		}
		if name = lookup(members, "model"); !plainString(name) {
			return "body_shape" // never: the intake writes the served model's name
		}
	}
	asked := string(name[1 : len(name)-1])
	m := t.models[asked]
	if m == nil {
		// Before any engine call, counted as the Python gateway counts it (intake.py
		// check_body): no route yet.
		s.route = "unknown"
		unknown := gatewayError(http.StatusNotFound, "NotFoundError",
			"The model `"+asked+"` does not exist.")
		unknown.param = "model"
		answerFailure(w, s, unknown)
		return ""
	}
	if m.route == routeUnavailable {
		// Held for a table with engines as the Python gateway holds it (planner.plan), then
		// answered as it answers (app.py fail: 503, counted no_endpoints).
		if t, m = p.awaitEngines(ctx, asked, t, m); m.route == routeUnavailable {
			s.route = "unknown"
			if r.Context().Err() != nil {
				s.outcome = "client_gone"
				return ""
			}
			w.Header().Set("Retry-After", "1")
			answerFailure(w, s, gatewayError(http.StatusServiceUnavailable, "ServiceUnavailableError", m.unavailable))
			s.outcome = "no_endpoints"
			return ""
		}
		if s.log != nil && t.requestLog != nil {
			s.log.names = t.requestLog // the engines it runs on are named by the table that brought them
		}
	}
	chat := r.URL.Path == "/v1/chat/completions"
	switch owned, unsure := gatewayOwned(members); {
	case unsure:
		return "validation"
	case owned != "":
		s.route = "unknown" // refused where the Python gateway refuses it (intake.py)
		answerFailure(w, s, gatewayOwnedRefused(owned))
		return ""
	}
	if t.tokensOnly {
		if param := tokenizerNeeded(members, chat); param != "" {
			s.route = "unknown" // refused where the Python gateway refuses it (intake.py)
			answerFailure(w, s, tokenizerRefused(param))
			return ""
		}
	}
	if t.maxTokensCap > 0 {
		over, fill, readable := capLimits(members, t.maxTokensCap, chat)
		switch {
		case !readable:
			return "max_tokens_cap"
		case over != "":
			s.route = "unknown" // refused where the Python gateway refuses it (intake.py)
			answerFailure(w, s, overCap(over, t.maxTokensCap))
			return ""
		case fill:
			capped := p.buffers.Get().(*bytes.Buffer)
			defer p.buffers.Put(capped)
			capped.Reset()
			limit := strconv.AppendInt(nil, t.maxTokensCap, 10)
			splice(capped, body, members, capDrops, []field{{"max_tokens", limit}})
			body = capped.Bytes()
			if members, err = topLevel(body); err != nil {
				return "max_tokens_cap"
			}
		}
	}
	stream := string(lookup(members, "stream")) == "true"
	if m.localReason != "" {
		p.stats.localPrefill(m.localReason) // as planner.settle counts each such request
	}
	s.route = planned(m)
	s.where = p.placing(t, m, members, r.Header.Get("X-Conversation-Id"))
	if stream && len(m.render) > 0 {
		if param := logprobsAsked(members, chat); param != "" {
			answerFailure(w, s, streamLogprobsRefused(param)) // tokens_route.py
			return ""
		}
	}
	id := "pdserve-" + requestID()
	s.id, s.clientID = id, r.Header.Get("X-Request-Id")
	if s.log != nil {
		s.log.parity = m.parity
		requested := lookup(members, "max_completion_tokens")
		if requested == nil {
			requested = lookup(members, "max_tokens")
		}
		s.log.requested = append([]byte(nil), requested...) // the body's buffer goes back first
	}
	auth := ""
	if t.passAuth {
		auth = r.Header.Get("Authorization")
	}
	if len(m.render) > 0 {
		return p.rendered(ctx, w, r, t, m, body, members, class, id, auth, stream, s)
	}
	prefill, decode := p.route(m, estimatedPromptTokens(members), s)
	release := func() {}
	if class.long(t.longBody > 0 && int64(len(body)) > t.longBody) && prefill != nil {
		// Fair prefill admission (this replica's queue, or its peers' leader's): a long
		// prompt holds a slot on one prefill replica while it prefills there.
		var granted *endpoint
		var reason fallback
		if granted, release, reason = p.admit(ctx, t, m, prefill, s); reason != "" {
			return reason
		}
		prefill, decode = granted, m.decodeFor(granted, s.where)
	}
	decodeBody := p.buffers.Get().(*bytes.Buffer)
	decodeBody.Reset()
	defer p.buffers.Put(decodeBody)
	var kv []byte
	if prefill != nil {
		var f *failure
		kv, decode, f = p.prefill(ctx, m, prefill, decode, r.URL.Path, body, members, id, auth, release, s)
		if f != nil {
			return p.failed(w, s, f)
		}
		s.kvToDecode = kv != nil
		openaiDecodeBody(decodeBody, body, members, kv)
		p.stats.pd.Add(1)
		s.route = routePD
	} else {
		decodeBody.Write(body)
		p.stats.decode.Add(1)
		s.route = routeDecode
	}
	local := func(into *bytes.Buffer) []byte { // without prefill's KV: decode prefills itself
		into.Reset()
		openaiDecodeBody(into, body, members, nil)
		return into.Bytes()
	}
	if kv != nil && p.leaseRanOut(m, s, false, id, auth) {
		local(decodeBody)
		kv = nil
	}
	if stream {
		return p.decode(ctx, w, r, decode, decodeBody.Bytes(), id, auth, s)
	}
	answer := p.buffers.Get().(*bytes.Buffer)
	defer p.buffers.Put(answer)
	if kv == nil {
		local = nil
	}
	decoded, f := p.decodeOnce(ctx, m, decode, r.URL.Path, decodeBody.Bytes(), local, id, auth, answer, s)
	if f != nil {
		return p.failed(w, s, f)
	}
	s.ran("decode", decoded)
	written := answer.Bytes()
	fields, err := topLevel(written)
	if err != nil || !allObjects(lookup(fields, "choices")) {
		return p.failed(w, s, noChoices)
	}
	if lookup(fields, "kv_transfer_params") != nil {
		trimmed := p.buffers.Get().(*bytes.Buffer)
		trimmed.Reset()
		defer p.buffers.Put(trimmed)
		splice(trimmed, written, fields, decodeDrops, nil)
		written = trimmed.Bytes()
	}
	if s.log != nil {
		s.log.usage(written)
	}
	nameResponse(w.Header(), r, id)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(written)))
	if _, err := w.Write(written); err != nil {
		s.outcome = "client_gone"
	}
	return ""
}

// plainString: a JSON string without escapes (read as its bytes).
func plainString(raw []byte) bool {
	return len(raw) >= 2 && raw[0] == '"' && bytes.IndexByte(raw, '\\') < 0
}

// checked puts a request to the Python gateway's intake (intake.go): the body to serve and its
// members, or nil when the client was answered (then reason is "": the intake's verdict, or a
// 503 when the intake could not be asked) or, with no intake (tests), handed over for `why`.
func (p *plane) checked(ctx context.Context, w http.ResponseWriter, r *http.Request, body []byte,
	s *served, why fallback) ([]byte, []member, fallback) {
	if p.intake == nil {
		return nil, nil, why
	}
	v, err := p.intake.check(ctx, r, body)
	if err != nil {
		s.route = "unknown"
		if r.Context().Err() != nil {
			s.outcome = "client_gone"
			return nil, nil, ""
		}
		// The Python gateway listens before the data plane starts and stops after it: an
		// intake that cannot be asked is one that crashed or is overloaded, which would serve
		// a handed-over request no better. The client retries, elsewhere if this pod is gone.
		log.Printf("pdserve-dataplane: the Python gateway's intake: %v", err)
		w.Header().Set("Retry-After", "1")
		answerFailure(w, s, gatewayError(http.StatusServiceUnavailable, "ServiceUnavailableError",
			"the gateway could not check this request now: retry shortly"))
		return nil, nil, ""
	}
	p.stats.intake.Add(1)
	if v.status != http.StatusOK {
		answerVerdict(w, s, v)
		return nil, nil, ""
	}
	members, err := topLevel(v.body)
	if err != nil || duplicated(members) {
		return nil, nil, why // never: the intake writes each member once
	}
	return v.body, members, ""
}

// refuseTooLarge answers a body over -max-body-bytes as the Python gateway does (a 413, the
// connection closed after it, what the client still sends dropped as it comes), counted as it
// counts it.
func (p *plane) refuseTooLarge(w http.ResponseWriter, r *http.Request) {
	p.metrics.count("unknown", "error_413")
	f := tooLarge(p.maxBody)
	refuseBeforeBody(w, r, f.status, f.kind, f.message)
}

// route: the engines for one request, P/D or not as the model's route says, or as Auto mode
// decides for a prompt of `promptTokens`. What it teaches (its handoff, prefill's speed, its
// answer's length) is reported in every mode, as the Python gateway's requests teach its
// model (and fill the kv_handoff stage) whatever the mode.
func (p *plane) route(m *model, promptTokens int64, s *served) (prefill, decode *endpoint) {
	s.promptTokens, s.learn = promptTokens, &p.auto
	if m.route != routeAuto {
		return m.pick(s.where)
	}
	d := p.auto.decide(m.auto, m, promptTokens, p.queue.waiting())
	s.prefillOnly = d.Prefill
	if s.log != nil {
		s.log.autoReason = d.Reason
	}
	s.stepWindow = time.Duration(m.auto.StepWindowSeconds * float64(time.Second))
	return m.pickAuto(d, m.auto.LocalOnPrefillPool, s.where)
}

// estimatedPromptTokens: without render servers there are no token ids, so about 4 bytes of
// the prompt's JSON a token (exchange.estimated_prompt_tokens, which counts its compact
// re-encoding: the same for a compact body).
func estimatedPromptTokens(members []member) int64 {
	prompt := lookup(members, "messages")
	if empty := string(prompt); empty == "" || empty == "null" || empty == "[]" {
		prompt = lookup(members, "prompt")
	}
	if len(prompt) == 0 || string(prompt) == "null" {
		return 0
	}
	return int64(len(prompt) / 4)
}

// failed answers a failure after engine work began, as the Python gateway would (counted by s).
func (p *plane) failed(w http.ResponseWriter, s *served, f *failure) fallback {
	if f == errClientLeft {
		s.outcome = "client_gone"
		return ""
	}
	answerFailure(w, s, f)
	return ""
}

// planned is the route a model's requests take, as the Python gateway names it from the start
// (a request that ends before its answer is counted by it).
func planned(m *model) string {
	switch {
	case len(m.render) > 0 && m.route == routePD:
		return routeRenderPD
	case len(m.render) > 0:
		return routeRenderDecode
	case m.route == routePD:
		return routePD
	}
	return routeDecode
}

// prefill runs the P/D prefill (hops.py prefill): its kv_transfer_params and the decode
// replica that can pull them. When no prefill replica could serve it, or one answered without
// kv_transfer_params, kv is nil: decode prefills locally, the fallback counted as the Python
// gateway counts it. A failure comes back only when the client must get it (an engine's 4xx,
// the request's deadline). `release` gives the admission slot back once prefill is done.
func (p *plane) prefill(ctx context.Context, m *model, e, decode *endpoint, path string, body []byte,
	members []member, id, auth string, release func(), s *served) ([]byte, *endpoint, *failure) {
	buffer := p.buffers.Get().(*bytes.Buffer)
	buffer.Reset()
	defer p.buffers.Put(buffer)
	openaiPrefillBody(buffer, body, members, handoff)
	return p.prefillCall(ctx, m, e, decode, path, buffer.Bytes(), id, auth, release, s)
}

// openaiPrefillBody is protocol.openai_prefill_body: the client's request cut to prefill only
// (one token, one choice, not streamed, no stream_options or min_tokens), with the handoff.
func openaiPrefillBody(dst *bytes.Buffer, body []byte, members []member, handoff []byte) {
	extra := []field{{"stream", []byte("false")}, {"max_tokens", []byte("1")}, {"n", []byte("1")}}
	if lookup(members, "max_completion_tokens") != nil {
		extra = append(extra, field{"max_completion_tokens", []byte("1")})
	}
	extra = append(extra, field{"kv_transfer_params", handoff})
	splice(dst, body, members, prefillDrops, extra)
}

// openaiDecodeBody is protocol.openai_decode_body: the client's request, with prefill's
// kv_transfer_params when kv is given (nil: decode prefills itself).
func openaiDecodeBody(dst *bytes.Buffer, body []byte, members []member, kv []byte) {
	var extra []field
	if kv != nil {
		extra = []field{{"kv_transfer_params", kv}}
	}
	splice(dst, body, members, decodeDrops, extra)
}

// prefillCall posts a prefill request to `first`, then to the model's other prefill replicas,
// as post_json does, and reads where decode pulls the KV from.
func (p *plane) prefillCall(ctx context.Context, m *model, first, decode *endpoint, path string,
	request []byte, id, auth string, release func(), s *served) ([]byte, *endpoint, *failure) {
	answer := p.buffers.Get().(*bytes.Buffer)
	defer p.buffers.Put(answer)
	started := time.Now()
	served, f := p.callJSON(ctx, "prefill", []*endpoint{first}, path, request, id, auth,
		p.upstream.firstByte, true, s.promptTokens, answer)
	if f != nil && !f.final && !f.kv {
		if others := m.otherPrefills(first, s.prefillOnly, s.where); len(others) > 0 {
			served, f = p.callJSON(ctx, "prefill", others, path, request, id, auth,
				p.upstream.firstByte, true, s.promptTokens, answer)
		}
	}
	release() // the slot is for prefill's work, as in the Python gateway
	switch {
	case f != nil && f.final:
		return nil, nil, f
	case f != nil:
		p.stats.localPrefill("prefill_failed")
		return nil, decode, nil
	}
	p.metrics.stage.observe("prefill", time.Since(started))
	// Decode is picked now, by the engines' loads after prefill (as the Python gateway picks
	// it), not those when the request arrived: a burst's decodes would all go to one engine.
	decode = m.decodeFor(served, s.where)
	fields, err := topLevel(answer.Bytes())
	kv := lookup(fields, "kv_transfer_params")
	if err != nil || len(kv) == 0 || kv[0] != '{' {
		p.stats.localPrefill("no_kv_params")
		return nil, decode, nil
	}
	s.prefilled(served, time.Since(started))
	s.ran("prefill", served)
	return append([]byte(nil), kv...), decode, nil
}

// leaseRanOut is hops.lease_ran_out: whether a decode sent now would find prefill's KV gone
// (the routing config's lease from prefill's answer on, less the gateway's margin). Then the
// request prefills locally on decode: counted, and a tokens engine's prefill (`tokens`) lets
// its blocks go at once (an OpenAI engine has no abort endpoint).
func (p *plane) leaseRanOut(m *model, s *served, tokens bool, id, auth string) bool {
	if !m.bounded || s.prefillDone.IsZero() || time.Since(s.prefillDone) < m.kvStartWithin {
		return false
	}
	p.stats.localPrefill("lease_expiring")
	if tokens && s.prefillServer != nil {
		p.abort(s.prefillServer, id, auth)
	}
	s.kvToDecode = false
	return true
}

// decodeOnce is hops.py decode_once: the decode call whose answer comes whole, on `first`, then
// the model's other decode replicas; `local` (nil without prefill's KV) writes the request
// without it, for the retry when the replicas given the KV failed (or could not load it). The
// answer is read into `into`, and the replica that gave it comes back; else what the client gets.
func (p *plane) decodeOnce(ctx context.Context, m *model, first *endpoint, path string, body []byte,
	local func(*bytes.Buffer) []byte, id, auth string, into *bytes.Buffer, s *served) (*endpoint, *failure) {
	limit := p.timeouts.request
	served, f := p.callJSON(ctx, "decode", []*endpoint{first}, path, body, id, auth, limit, true, 0, into)
	if f != nil && !f.final {
		others := m.otherDecodes(first, s.where)
		if f.kv && len(others) == 0 {
			others = []*endpoint{first} // it answered: it may prefill the request itself
		}
		if local != nil && f.kv {
			p.stats.localPrefill("kv_load_failed")
		}
		if len(others) > 0 && (local != nil || !f.kv) {
			if local != nil && !f.kv {
				p.stats.retry("decode", "upstream_error") // decode_once's: on, with local prefill
			}
			retry := body
			if local != nil {
				request := p.buffers.Get().(*bytes.Buffer)
				defer p.buffers.Put(request)
				retry = local(request)
				s.kvToDecode = false // the retry prefills itself: prefill's KV is not pulled
			}
			served, f = p.callJSON(ctx, "decode", others, path, retry, id, auth, limit, true, 0, into)
		}
	}
	if f != nil && !f.final { // decode_once answers what no replica could serve as a 502
		f.status, f.kind = http.StatusBadGateway, "UpstreamError"
	}
	return served, f
}

// noChoices: a decode answer with nothing to derender or pass on (a broken engine, or what
// stands in front of it), checked by the caller as it reads the answer.
var noChoices = &failure{status: http.StatusBadGateway, kind: "UpstreamError",
	message: "decode answered without choices", final: true}

// post sends one upstream request (the request id the engine names its work by, and the
// client's credentials when the table passes them on).
func (p *plane) post(ctx context.Context, e *endpoint, path string, body []byte,
	id, auth string) (*upBody, error) {
	return p.upstream.post(ctx, e.at, path, body, id, auth)
}

// decode opens decode's stream and passes its events through as the Python gateway's
// _proxy_stream does: each event checked (a malformed one, or the stream cut, timed out or
// ended without every choice's finish_reason, ends it with an error event), decode's own error
// events passed on without the addresses they name; [DONE] last either way.
func (p *plane) decode(ctx context.Context, w http.ResponseWriter, r *http.Request, e *endpoint,
	body []byte, id, auth string, s *served) fallback {
	e.inflight.Add(1)
	defer e.inflight.Add(-1)
	owed := s.promptTokens // it prefills the prompt itself unless prefill's KV comes with it
	if s.kvToDecode {
		owed = 0
	}
	prefilled := e.owe(owed)
	defer prefilled()
	response, f := p.openStream(ctx, e, r.URL.Path, body, id, auth)
	if f != nil {
		if f.answered != "" {
			f.message = f.answered // _proxy_stream passes on the engine's words alone
		}
		return p.failed(w, s, f)
	}
	defer response.Close()
	s.ran("decode", e)
	p.stats.streams.Add(1)
	nameResponse(w.Header(), r, id)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	flush := flushWhenIdle(w, response)
	chunk := p.chunks.Get().(*[]byte)
	defer p.chunks.Put(chunk)
	timer := time.AfterFunc(p.upstream.firstByte, response.expire)
	defer timer.Stop()
	first := true
	var events eventCheck
	pending := (*chunk)[:0]
	done, broke, gone, reported := false, "", false, false
	for !done && broke == "" && !gone {
		if len(pending) == cap(pending) { // a line longer than the buffer: rare, grown
			pending = append(pending, 0)[:len(pending)]
		}
		n, err := response.Read(pending[len(pending):cap(pending)])
		pending = pending[:len(pending)+n]
		start, at := 0, 0
		for !done && broke == "" {
			end := bytes.IndexByte(pending[at:], '\n')
			if end < 0 {
				break
			}
			line, next := pending[at:at+end], at+end+1
			data, isData := bytes.CutPrefix(bytes.TrimSuffix(line, []byte("\r")), []byte("data: "))
			if isData {
				first = false
				prefilled()
				timer.Reset(p.timeouts.idle)
				if string(data) != "[DONE]" {
					s.event(e)
				}
				switch verdict := events.check(data); verdict {
				case eventDone:
					done = true
					next = len(pending) // nothing after decode's [DONE] is passed on
				case eventMalformed:
					broke = "decode sent a malformed event (" + events.why + ")"
				case eventError:
					reported = true
					if scrubbed := scrubbedEvent(data); scrubbed != nil {
						gone = gone || write(w, pending[start:at]) != nil ||
							write(w, fmt.Appendf(nil, "data: %s\n\n", scrubbed)) != nil
						start = next
					}
				}
				if done || broke != "" {
					pending = pending[:at]
					break
				}
			}
			at = next
		}
		if at > start && !gone {
			if write(w, pending[start:at]) != nil {
				gone = true
			} else {
				s.chunk()
				if err == nil && !done {
					flush.written()
				}
			}
		}
		pending = pending[:copy(pending, pending[min(at, len(pending)):])]
		if err == io.EOF {
			break
		}
		if err != nil && broke == "" && !done {
			if r.Context().Err() != nil {
				gone = true
			} else if response.expired.Load() {
				broke = "decode stream timed out: " + quietFor(first, p.timeouts.idle)
			} else {
				broke = streamBroke(ctx)
			}
		}
	}
	if gone || r.Context().Err() != nil {
		s.outcome = "client_gone" // closing decode's connection aborts its work
		return ""
	}
	switch {
	case reported:
		s.outcome = "error_502"
	case !done || !events.complete() || broke != "":
		status := http.StatusBadGateway
		if response.expired.Load() || ctx.Err() != nil {
			status = http.StatusGatewayTimeout
		}
		if broke == "" {
			broke = "decode closed it"
			if done {
				broke = "decode sent [DONE] before a finish_reason"
			}
		}
		s.outcome = "error_" + strconv.Itoa(status)
		_, _ = fmt.Fprintf(w, "data: %s\n\n", streamError(status, "decode stream ended before the answer was complete: "+broke))
	}
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
	return ""
}

// quietFor: what a stream the timer closed waited for (sse_data's words).
func quietFor(first bool, idle time.Duration) string {
	if first {
		return "no first event"
	}
	return "no event for " + pySeconds(idle) + " s"
}

// streamBroke: why a stream's read failed, as the Python gateway words it (aiohttp's error
// for a stream cut short is a ClientPayloadError).
func streamBroke(ctx context.Context) string {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return "decode stream timed out: the request's deadline passed"
	}
	return "decode stream broke (ClientPayloadError)"
}

func write(w http.ResponseWriter, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	_, err := w.Write(data)
	return err
}

// openStream opens a streamed decode call (UpstreamClient.post_stream and what _proxy_stream
// answers when it fails): its head within the first-byte timeout.
func (p *plane) openStream(ctx context.Context, e *endpoint, path string, body []byte,
	id, auth string) (*upBody, *failure) {
	if at, ok := ctx.Deadline(); ok && !time.Now().Before(at) {
		return nil, p.pastDeadlineFailure("decode", e)
	}
	response, err := p.post(ctx, e, path, body, id, auth)
	if err != nil {
		if errors.Is(ctx.Err(), context.Canceled) {
			return nil, errClientLeft
		}
		if ctx.Err() != nil || timedOut(err) {
			return nil, &failure{status: http.StatusGatewayTimeout, kind: "GatewayTimeout", final: ctx.Err() != nil, timedOut: true,
				message: p.outOfTime("decode", e.url, err, p.upstream.firstByte)}
		}
		return nil, upstreamFailed("decode at "+e.url+": "+callFailure(err), false)
	}
	if response.status != http.StatusOK {
		defer response.Close()
		payload, _ := io.ReadAll(io.LimitReader(response, 1<<20))
		f := gatewayError(http.StatusBadGateway, "UpstreamError", upstreamMessage(payload))
		if response.status < 500 {
			f.status = response.status
		} else {
			f.final = false // another replica may serve it (tokens route)
			f.kv = strings.Contains(f.message, "KV transfer")
			f.answered = f.message
			f.message = fmt.Sprintf("decode at %s: HTTP %d: %s", e.url, response.status, f.message)
		}
		return nil, f
	}
	e.served.Add(1)
	return response, nil
}

// admit waits for a long-prefill slot on one of the model's prefill replicas (`best` first,
// then as pick ranks them; with s.prefillOnly, of those servers alone) in this replica's
// queue, or while another gateway replica leads admission through the Python gateway, and
// holds it until release.
func (p *plane) admit(ctx context.Context, t *table, m *model, best *endpoint, s *served) (*endpoint, func(), fallback) {
	ranked := m.rankedPrefill(best, s.prefillOnly, s.where)
	// Slots are per server, however many of its data-parallel ranks the table names.
	urls := make([]string, 0, len(ranked))
	for _, e := range ranked {
		if !slices.Contains(urls, e.url) {
			urls = append(urls, e.url)
		}
	}
	acquire := p.admission.acquire
	if t.admitHere {
		acquire = p.queue.acquire
	}
	url, release, err := acquire(ctx, urls)
	if err != nil && !t.admitHere && ctx.Err() == nil {
		// The leader's slot could not be asked for through the Python gateway: admitted in
		// this replica's own queue, as the Python gateway admits when its leader is
		// unavailable (peers.slot), counted as its leader errors are.
		p.stats.leaderErrors.Add(1)
		url, release, err = p.queue.acquire(ctx, urls)
	}
	if err != nil {
		return nil, nil, "admission_failed" // the request's time ran out: answered 504
	}
	for _, e := range ranked {
		if e.url == url {
			return e, release, ""
		}
	}
	release()
	return nil, nil, "admission_failed"
}

// pythonUnavailable answers for the Python gateway while it is not listening (starting, or
// stopping: the data plane outlives it by its drain), in its words.
func pythonUnavailable(w http.ResponseWriter, _ *http.Request, err error) {
	log.Printf("pdserve-dataplane: the Python gateway did not answer: %v", err)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Retry-After", "1")
	w.WriteHeader(http.StatusServiceUnavailable)
	fmt.Fprint(w, `{"error":{"message":"the gateway is starting or stopping: retry shortly","type":"ServiceUnavailableError","param":null,"code":503}}`)
}

// toPython hands the request, its body already read (unless nil), to the Python gateway, with
// the time spent on it since s began.
func (p *plane) toPython(w http.ResponseWriter, r *http.Request, body []byte, reason fallback, s *served) {
	p.stats.fallback(string(reason))
	if body != nil {
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.ContentLength = int64(len(body))
	}
	p.python.ServeHTTP(w, withHandOverStart(r, s.started))
}

var idCounter atomic.Uint64
var idPrefix = fmt.Sprintf("%x", time.Now().UnixNano())

func requestID() string {
	return idPrefix + "-" + strconv.FormatUint(idCounter.Add(1), 36)
}

// ---- control ----------------------------------------------------------------------------------

func (p *plane) putTable(w http.ResponseWriter, r *http.Request) {
	raw, err := io.ReadAll(io.LimitReader(r.Body, 16<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	p.tableMu.Lock()
	defer p.tableMu.Unlock()
	t, engines, err := build(raw, p.engines)
	if err != nil {
		http.Error(w, err.Error(), http.StatusUnprocessableEntity)
		return
	}
	if p.requireKeys && len(t.keys) == 0 {
		// Pushed by anyone but the gateway (or a bug in it), it would open the gateway to all.
		http.Error(w, "routing table: apiKeySha256 is empty, but the gateway requires API keys "+
			"(-require-api-keys): send the SHA-256 digests of its keys", http.StatusUnprocessableEntity)
		return
	}
	if old := p.current.Load(); old != nil && t.version < old.version {
		http.Error(w, fmt.Sprintf("routing table version %d is older than %d", t.version, old.version), http.StatusConflict)
		return
	}
	p.engines = engines
	p.current.Store(t)
	if p.tableMoved != nil {
		close(p.tableMoved) // the requests waiting for engines look again
		p.tableMoved = nil
	}
	p.queue.configure(t.admission)
	w.WriteHeader(http.StatusNoContent)
}

// getStats: ?after=N leaves out the Auto-mode observations up to N, which the caller folded.
func (p *plane) getStats(w http.ResponseWriter, r *http.Request) {
	after, _ := strconv.ParseInt(r.URL.Query().Get("after"), 10, 64)
	out := map[string]any{
		// Served by route: the Python gateway's metric labels, named here only.
		"routes": map[string]int64{routePD: p.stats.pd.Load(), routeDecode: p.stats.decode.Load(),
			routeRenderPD: p.stats.renderPD.Load(), routeRenderDecode: p.stats.renderDecode.Load()},
		"metrics":   p.metrics.snapshot(),
		"streams":   p.stats.streams.Load(),
		"fallbacks": snapshot(&p.stats.fallbacks),
		// Requests served by local prefill, by the Python gateway's reason: its own fallbacks.
		"localPrefill": snapshot(&p.stats.localPrefills),
		"retries":      snapshot(&p.stats.retries),
		"aborts":       p.stats.aborts.Load(),
		"leaderErrors": p.stats.leaderErrors.Load(),
		"unreadable":   p.stats.unreadable.Load(),
		"intake":       p.stats.intake.Load(),
		"inflight":     p.inflight.Load(),
		"runtime":      runtimeStats(),
		"auto":         p.auto.snapshot(after),
		"bidirectional": map[string]any{"reuse": snapshot(&p.stats.reuse),
			"reusedTokens": p.stats.reusedTokens.Load(), "held": p.holds.snapshot()},
	}
	if p.requestLog != nil {
		out["requestLog"] = p.requestLog.snapshot() // entries written, and dropped
	}
	admission := p.queue.state()
	if t := p.current.Load(); t != nil {
		out["version"] = t.version
		admission.AdmitsHere = t.admitHere
	}
	out["admission"] = admission
	p.tableMu.Lock()
	// By engine as the table names it: requests served; calls in flight now (render servers'
	// are the render autoscaler's gauge), where any are; the step time its streams measured.
	served, inflight, steps := map[string]int64{}, map[string]int64{}, map[string]float64{}
	for key, e := range p.engines {
		served[key] = e.served.Load()
		if n := e.inflight.Load(); n > 0 {
			inflight[key] = n
		}
		if seconds, known := e.steps.read(); known {
			steps[key] = seconds
		}
	}
	p.tableMu.Unlock()
	out["served"], out["engineInflight"], out["stepSeconds"] = served, inflight, steps
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

func seconds(value float64) time.Duration {
	if value <= 0 {
		fmt.Fprintln(os.Stderr, "pdserve-dataplane: timeouts must be positive numbers of seconds")
		os.Exit(2)
	}
	return time.Duration(value * float64(time.Second))
}

func main() {
	listen := flag.String("listen", "0.0.0.0:8000", "where clients connect")
	pythonURL := flag.String("python", "", "the Python gateway's URL (loopback)")
	control := flag.String("control", "127.0.0.1:0", "the control API's address (loopback)")
	maxBody := flag.Int64("max-body-bytes", 32<<20, "larger bodies go to the Python gateway (its 413)")
	maxInflight := flag.Int64("max-inflight", 4096, "completion requests in flight, served here or handed over; more are answered 429")
	connect := flag.Float64("connect-timeout-seconds", 5, "opening a connection to an engine")
	firstByte := flag.Float64("first-byte-timeout-seconds", 120, "an engine's answer's first byte (its headers)")
	idle := flag.Float64("idle-timeout-seconds", 60, "between two reads of a decode stream")
	whole := flag.Float64("request-timeout-seconds", 600, "a whole request")
	renderTimeout := flag.Float64("render-timeout-seconds", 30, "one render or derender call")
	bodyTimeout := flag.Float64("body-timeout-seconds", 30, "receiving a completion's request body (408 after)")
	keepAlive := flag.Float64("keepalive-timeout-seconds", 75, "an idle kept-alive client connection is closed after this (and a request's head must arrive within it)")
	requireKeys := flag.Bool("require-api-keys", false, "refuse a routing table without API key digests (the gateway checks API keys)")
	gcPercent := flag.Int("gc-percent", 400, "the garbage collector's GOGC: the live heap is small, so collecting less often saves CPU per request (-1: only at -memory-limit-mib)")
	memoryLimit := flag.Int64("memory-limit-mib", 0, "a soft limit the heap is collected at however -gc-percent is set (0: -memory-limit-share of the container's memory limit)")
	memoryShare := flag.Int64("memory-limit-share", 40, "without -memory-limit-mib, the heap's soft limit in percent of the container's memory limit (cgroup), which the Python gateway in the same container shares (0: none)")
	buckets := flag.String("latency-buckets", "", "the latency histograms' bucket bounds in seconds, comma-separated (the Python gateway passes its own)")
	countBuckets := flag.String("count-buckets", "", "the derender count histograms' bucket bounds, comma-separated (the Python gateway passes its own)")
	admission := flag.String("admission", "", "the Python gateway's admission channel (loopback host:port) for long prompts' prefill slots")
	withParent := flag.Bool("exit-with-stdin", false, "stop when standard input closes (the Python gateway that started it is gone)")
	logFD := flag.Int("request-log-fd", -1, "an open file descriptor the request log's entries of the requests served here are written to, a line per write (the Python gateway passes its own --request-log)")
	flag.Parse()
	target, err := url.Parse(*pythonURL)
	if err != nil || target.Host == "" {
		fmt.Fprintln(os.Stderr, "pdserve-dataplane: -python must be the Python gateway's URL, e.g. http://127.0.0.1:8001")
		os.Exit(2)
	}
	token := os.Getenv(tokenVariable)
	if token == "" {
		fmt.Fprintln(os.Stderr, "pdserve-dataplane: set "+tokenVariable+": the control API answers only calls that present it (Authorization: Bearer <token>); the Python gateway sets it")
		os.Exit(2)
	}
	// To the Python gateway on loopback: its answers take as long as the requests it serves.
	transport := &http.Transport{MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024,
		IdleConnTimeout: 30 * time.Second, DisableCompression: true}
	python := pythonProxy(target, token, transport)
	intake := &intakeClient{base: strings.TrimSuffix(target.String(), "/"), token: token,
		client: &http.Client{Transport: transport}, limit: 2 * *maxBody}
	p := &plane{python: python, maxBody: *maxBody,
		upstream:    newUpstreamPool(seconds(*connect), seconds(*firstByte), 90*time.Second),
		maxInflight: *maxInflight, requireKeys: *requireKeys, engines: map[string]*endpoint{},
		queue: newFairQueue(), intake: intake}
	// The token tells the Python gateway its own data plane from anyone else on loopback; a
	// slot it asked for is held at most as long as its prefill call may wait for an answer.
	p.admission = newAdmissionChannel(*admission, token, p.queue, seconds(*firstByte))
	if *admission != "" {
		go p.admission.keepConnected(100 * time.Millisecond)
	}
	bounds, err := parseBounds("latency-buckets", *buckets)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pdserve-dataplane:", err)
		os.Exit(2)
	}
	counts, err := parseBounds("count-buckets", *countBuckets)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pdserve-dataplane:", err)
		os.Exit(2)
	}
	p.metrics = newServedMetrics(bounds, counts)
	if p.requestLog, err = openRequestLog(*logFD); err != nil {
		fmt.Fprintln(os.Stderr, "pdserve-dataplane:", err)
		os.Exit(2)
	}
	p.buffers.New = func() any { return new(bytes.Buffer) }
	p.chunks.New = func() any { chunk := make([]byte, 32*1024); return &chunk }
	p.timeouts = timeouts{idle: seconds(*idle), request: seconds(*whole), body: seconds(*bodyTimeout),
		render: seconds(*renderTimeout)}
	debug.SetGCPercent(*gcPercent)
	if *memoryLimit == 0 && *memoryShare > 0 {
		*memoryLimit = heapLimit(cgroupMemoryFiles, *memoryShare) >> 20
	}
	if *memoryLimit > 0 {
		debug.SetMemoryLimit(*memoryLimit << 20)
		log.Printf("pdserve-dataplane: the heap is collected at %d MiB at the latest", *memoryLimit)
	}

	var server *http.Server
	// Draining: each answer closes its connection from then on, so clients move on.
	controlAPI := p.controlAPI(token, func() { server.SetKeepAlivesEnabled(false) })
	controlListener, err := net.Listen("tcp", *control)
	if err != nil {
		log.Fatalf("pdserve-dataplane: -control %s: %v", *control, err)
	}
	clientListener, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("pdserve-dataplane: -listen %s: %v", *listen, err)
	}
	// The Python gateway reads where the control API and the client port landed.
	fmt.Printf(`{"control":%q,"listen":%q}`+"\n", controlListener.Addr().String(), clientListener.Addr().String())

	// Completions by exact method and path, everything else to the Python gateway as sent: a
	// ServeMux cleans paths and redirects (`/v1/chat/completions/../completions`, POST
	// included) where the Python gateway answers the path as sent (404).
	client := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Go's server answers Expect: 100-continue itself (framing.go refused any other
		// value): the Python gateway must not send a second 100 Continue through the proxy.
		delete(r.Header, "Expect")
		if r.Method == http.MethodPost && (r.URL.Path == "/v1/chat/completions" || r.URL.Path == "/v1/completions") {
			p.serveCompletion(w, r)
			return
		}
		python.ServeHTTP(w, r)
	})
	server = &http.Server{Handler: client, ReadHeaderTimeout: seconds(*keepAlive), IdleTimeout: seconds(*keepAlive),
		// framing.go's checks are the limits; `OPTIONS *` is the Python gateway's (404).
		MaxHeaderBytes: maxHeaderBytes, ConnState: trackServerState, DisableGeneralOptionsHandler: true}
	go func() { log.Fatal(http.Serve(controlListener, controlAPI)) }()
	stop := make(chan os.Signal, 2)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	if *withParent {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			stop <- syscall.SIGTERM
		}()
	}
	stopped := make(chan struct{})
	go func() {
		<-stop
		// Stop accepting and finish what it holds (the Python gateway drains before it stops
		// the data plane, so clients have moved on by then).
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		_ = server.Shutdown(ctx)
		close(stopped)
	}()
	if err := server.Serve(framedListener{rawListener{clientListener}, *maxBody}); !errors.Is(err, http.ErrServerClosed) {
		log.Fatal(err)
	}
	<-stopped
	p.requestLog.close() // what waits is written before the process ends
}
