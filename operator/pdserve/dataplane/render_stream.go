package main

// The render route streamed: decode's token-id events turned into the client's OpenAI chunks
// by derender calls, as the Python gateway's derender pipeline does (gateway/streaming.py):
// per choice at most one derender call in flight, the tokens that arrive meanwhile merged into
// the next one (light load is per token, heavy load batches itself and costs render less CPU).
// The stream always ends with every choice's finish_reason or an error event, then [DONE].

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// rendering is what every derender call of one request shares.
type rendering struct {
	bidi        *bidiRequest // nil: decode holds nothing of it for a next turn (bidirectional.go)
	chat        bool
	model       []byte // the model's name, a JSON string
	quotedID    []byte
	id, auth    string
	tokens      []byte // the prompt's token ids (a JSON array)
	count       int
	request     []byte // the client's body
	pipelining  bool
	renderer    *endpoint
	routed      *model // its render servers, for a derender call's retry
	includeStop bool
	stopHold    int // characters a stream holds back for stop strings (stream_stop.go)
	served      *served
}

// streamWriter serializes the chunks of one client stream; a failed write means the client
// left, and ends everything working for it.
type streamWriter struct {
	mu      sync.Mutex
	w       http.ResponseWriter
	flusher http.Flusher
	gone    atomic.Bool
	cancel  context.CancelFunc
	served  *served // guarded by mu
}

func (s *streamWriter) event(data []byte) { s.write(data, true, false) }

// chunk sends a chunk of the answer (measured as one).
func (s *streamWriter) chunk(data []byte) { s.write(data, true, true) }

// write sends one event; unflushed, it goes out with the next flushed one or the stream's end.
func (s *streamWriter) write(data []byte, flush, answer bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gone.Load() {
		return
	}
	if _, err := s.w.Write(append(append([]byte("data: "), data...), '\n', '\n')); err != nil {
		s.gone.Store(true)
		s.cancel()
		return
	}
	if answer {
		s.served.chunk()
	}
	if flush && s.flusher != nil {
		s.flusher.Flush()
	}
}

// piece is what one decode event carried for one choice.
type piece struct {
	ids       []byte // the token ids, without brackets ("1,2")
	finish    []byte // the finish_reason's JSON, nil while the choice goes on
	stop      string // with finish: the stop string that ended the choice, cut from its text
	abandoned bool   // the stream ended without this choice's finish_reason
}

type derenderPipeline struct {
	index    []byte
	stops    *streamStop // the choice's text as sent, for stop strings (runPipeline's own)
	mu       sync.Mutex
	pending  []piece
	wake     chan struct{}
	finished bool // decode sent this choice's finish_reason
	done     chan struct{}
	err      error // the derender call that failed, once done
}

func (p *plane) startPipeline(ctx context.Context, rs *rendering, index []byte, out *streamWriter) *derenderPipeline {
	pipeline := &derenderPipeline{index: append([]byte(nil), index...), wake: make(chan struct{}, 1),
		done: make(chan struct{}), stops: newStreamStop(rs.stopHold)}
	go func() {
		defer close(pipeline.done)
		pipeline.err = p.runPipeline(ctx, rs, pipeline, out)
	}()
	return pipeline
}

func (d *derenderPipeline) push(next piece) {
	d.mu.Lock()
	if d.finished {
		d.mu.Unlock()
		return // nothing comes after a finish reason
	}
	d.finished = next.finish != nil
	d.pending = append(d.pending, next)
	d.mu.Unlock()
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// take: the next call's tokens: one piece, or with pipelining every piece up to the one that
// finishes the choice.
func (d *derenderPipeline) take(pipelining bool) (piece, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.pending) == 0 {
		return piece{}, false
	}
	next := d.pending[0]
	d.pending = d.pending[1:]
	for pipelining && next.finish == nil && !next.abandoned && len(d.pending) > 0 {
		more := d.pending[0]
		d.pending = d.pending[1:]
		next.ids = joinIDs(next.ids, more.ids)
		next.finish, next.stop, next.abandoned = more.finish, more.stop, more.abandoned
	}
	return next, true
}

func joinIDs(a, b []byte) []byte {
	switch {
	case len(a) == 0:
		return b
	case len(b) == 0:
		return a
	}
	return append(append(append([]byte(nil), a...), ','), b...)
}

// idCount: how many token ids a piece's list holds ("1,2": 2).
func idCount(ids []byte) int {
	if len(bytes.TrimSpace(ids)) == 0 {
		return 0
	}
	return bytes.Count(ids, []byte(",")) + 1
}

// close ends the choice: what is queued is derendered; a choice decode never finished ends
// without a finish reason (the stream is then reported broken).
func (d *derenderPipeline) close() error {
	d.push(piece{abandoned: true})
	<-d.done
	return d.err
}

func (p *plane) runPipeline(ctx context.Context, rs *rendering, d *derenderPipeline, out *streamWriter) error {
	calls := 0
	// Per choice, as the Python gateway's pipeline counts them (streaming.py), however it ends.
	defer func() { p.metrics.derenderCalls.observeValue("", float64(calls)) }()
	var state []byte = []byte("null")
	// Pooled: every call's body carries the prompt's token ids and the client's request again.
	body, answer := p.buffers.Get().(*bytes.Buffer), p.buffers.Get().(*bytes.Buffer)
	defer p.buffers.Put(body)
	defer p.buffers.Put(answer)
	for {
		next, ok := d.take(rs.pipelining)
		if !ok {
			select {
			case <-d.wake:
				continue
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		if next.abandoned && len(next.ids) == 0 {
			return nil
		}
		finish := next.finish
		if finish == nil {
			finish = []byte("null")
		}
		calls++
		p.metrics.derenderTokens.observeValue("", float64(idCount(next.ids)))
		body.Reset()
		derenderChunkBody(body, rs, state, d.index, next.ids, finish)
		if _, f := p.renderJSON(ctx, rs.routed, "derender", derenderPath(rs.chat), body.Bytes(), rs.id, rs.auth, answer); f != nil {
			return f
		}
		fields, err := topLevel(answer.Bytes())
		chunk := lookup(fields, "chunk")
		chunkFields, chunkErr := topLevel(chunk)
		if err != nil || chunkErr != nil {
			return gatewayError(http.StatusBadGateway, "UpstreamError", "derender answered without a chunk")
		}
		if next := lookup(fields, "stream_state"); next != nil {
			state = append(state[:0:0], next...)
		}
		choices := lookup(chunkFields, "choices")
		if next.stop != "" || d.stops.hold > 0 {
			final := next.finish != nil || next.abandoned
			if fixed := d.stops.correctAll(choices, next.stop, final); !bytes.Equal(fixed, choices) {
				var cut bytes.Buffer
				splice(&cut, chunk, chunkFields, choicesDrops, []field{{"choices", fixed}})
				chunk, choices = cut.Bytes(), fixed
				chunkFields, _ = topLevel(chunk)
			}
		}
		if worthSending(choices) {
			var named bytes.Buffer
			splice(&named, chunk, chunkFields, idModelDrops, []field{{"id", rs.quotedID}, {"model", rs.model}})
			out.chunk(named.Bytes())
		}
		if next.finish != nil || next.abandoned {
			return nil
		}
	}
}

var idModelDrops = map[string]bool{"id": true, "model": true}

// worthSending: a chunk with something for the client (text, a role, tool calls, a finish).
func worthSending(choices []byte) bool {
	elements, err := arrayElements(choices)
	if err != nil {
		return false
	}
	for _, at := range elements {
		members, err := topLevel(choices[at.start:at.end])
		if err != nil {
			continue
		}
		if truthy(lookup(members, "finish_reason")) || truthy(lookup(members, "text")) {
			return true
		}
		delta, err := topLevel(lookup(members, "delta"))
		if err != nil {
			continue
		}
		for _, key := range []string{"role", "content", "reasoning", "tool_calls"} {
			if truthy(lookup(delta, key)) {
				return true
			}
		}
	}
	return false
}

func truthy(raw []byte) bool {
	switch string(bytes.TrimSpace(raw)) {
	case "", "null", `""`, "[]", "{}", "false", "0":
		return false
	}
	return true
}

func derenderChunkBody(dst *bytes.Buffer, rs *rendering, state, index, ids, finish []byte) {
	dst.Grow(len(rs.tokens) + len(rs.request) + len(state) + len(ids) + 256)
	dst.WriteString(`{"stream":true,"model":`)
	dst.Write(rs.model)
	dst.WriteString(`,"stream_state":`)
	dst.Write(state)
	dst.WriteString(`,"generate_chunk":{"request_id":`)
	dst.Write(rs.quotedID)
	dst.WriteString(`,"choices":[{"index":`)
	dst.Write(index)
	dst.WriteString(`,"token_ids":[`)
	dst.Write(ids)
	dst.WriteString(`],"finish_reason":`)
	dst.Write(finish)
	dst.WriteString(`,"logprobs":null}]},"prompt_tokens":` + strconv.Itoa(rs.count) + `,"prompt_token_ids":`)
	dst.Write(rs.tokens)
	if rs.chat {
		dst.WriteString(`,"chat_request":`)
	} else {
		dst.WriteString(`,"completion_request":`)
	}
	dst.Write(rs.request)
	dst.WriteByte('}')
}

// streamRendered sends the decode request and relays its stream through the derender
// pipelines. A failure before the stream's head is answered as open_decode_stream's (another
// decode replica first; one that could not load prefill's KV retried with local prefill);
// after it, the stream ends with an error event, and an unfinished one's decode is aborted.
func (p *plane) streamRendered(ctx context.Context, w http.ResponseWriter, r *http.Request,
	rs *rendering, decode *endpoint, body []byte, local func(*bytes.Buffer) []byte, usageAsked bool) fallback {
	decode.inflight.Add(1)
	defer decode.inflight.Add(-1)
	request := p.buffers.Get().(*bytes.Buffer)
	defer p.buffers.Put(request)
	// Each attempt that would send prefill's KV checks its lease first (open_decode_stream).
	withKV := local != nil
	withoutKV := func() {
		body, withKV = local(request), false
	}
	if withKV && p.leaseRanOut(rs.routed, rs.served, true, rs.id, rs.auth) {
		withoutKV()
	}
	response, f := p.openStream(ctx, decode, generatePath, body, rs.id, rs.auth)
	p.stats.streamRetried(f)
	// open_decode_stream: the next decode replica; once one could not load prefill's KV (the
	// first, or one tried after a replica that hung having pulled it), local prefill, that
	// replica last (it answered, so it may serve that).
	others := rs.routed.otherDecodes(decode, rs.served.where)
	for f != nil && !f.final {
		if f.kv && !withKV {
			break
		}
		if f.kv {
			p.stats.localPrefill("kv_load_failed")
			if rs.served.prefillServer != nil {
				p.abort(rs.served.prefillServer, rs.id, rs.auth) // what prefill still holds
			}
			withoutKV()
			others = append(others, decode)
		}
		if len(others) == 0 {
			break
		}
		if withKV && p.leaseRanOut(rs.routed, rs.served, true, rs.id, rs.auth) {
			withoutKV()
		}
		decode, others = others[0], others[1:]
		response, f = p.openStream(ctx, decode, generatePath, body, rs.id, rs.auth)
		p.stats.streamRetried(f)
	}
	if f != nil {
		return p.failed(w, rs.served, f)
	}
	defer response.Close()
	if rs.bidi != nil {
		rs.bidi.decodedOn, rs.bidi.pulled = decode, withKV
	}
	generated, ended := map[string]int{}, map[string]bool{} // per choice (bidirectional KV)
	rs.served.ran("decode", decode)
	p.stats.streams.Add(1)
	nameResponse(w.Header(), r, rs.id)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	flusher, _ := w.(http.Flusher)
	out := &streamWriter{w: w, flusher: flusher, cancel: cancel, served: rs.served}
	if flusher != nil {
		flusher.Flush()
	}
	// Why the stream would have gone quiet, and (once the timer closed it) why it did.
	var waiting, quiet atomic.Value
	waiting.Store("no first event")
	idle := fmt.Sprintf("no event for %g s", p.timeouts.idle.Seconds())
	timer := time.AfterFunc(p.upstream.firstByte, func() {
		quiet.Store(waiting.Load())
		response.Close()
	})
	defer timer.Stop()
	pipelines := []*derenderPipeline{}
	byIndex := map[string]*derenderPipeline{}
	var usage []byte
	done, broke := false, ""
	opened, firstEvent := time.Now(), true // decode_first_token: from the stream's head on
	reader := bufio.NewReaderSize(response, 32*1024)
	var line []byte
	for !done && broke == "" {
		var err error
		line, err = readLine(reader, line[:0])
		if err != nil {
			broke = streamBreak(ctx, &quiet)
			break
		}
		data, isData := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("data: "))
		if !isData {
			continue
		}
		waiting.Store(idle)
		timer.Reset(p.timeouts.idle)
		if string(data) == "[DONE]" {
			done = true
			break
		}
		rs.served.event(decode)
		members, err := topLevel(data)
		if err != nil {
			broke = "decode sent a malformed event (not a JSON object)"
			break
		}
		if failure := lookup(members, "error"); failure != nil {
			broke = "decode reported: " + string(failure)
			break
		}
		if u := lookup(members, "usage"); u != nil && string(u) != "null" {
			usage = append(usage[:0], u...)
		}
		choices := lookup(members, "choices")
		elements, err := arrayElements(choices)
		if choices != nil && string(choices) != "null" && err != nil {
			broke = "decode sent a malformed event (choices)"
			break
		}
		if firstEvent && len(elements) > 0 {
			firstEvent = false
			p.metrics.stage.observe("decode_first_token", time.Since(opened))
		}
		for _, at := range elements {
			choice, err := topLevel(choices[at.start:at.end])
			if err != nil {
				broke = "decode sent a malformed event (a choice)"
				break
			}
			index := lookup(choice, "index")
			if index == nil {
				index = []byte("0")
			}
			next, ok := eventPiece(choice, rs.includeStop)
			if !ok {
				broke = "decode sent a malformed event (token_ids)"
				break
			}
			if l := rs.served.log; l != nil { // every token decode sent, the stop token too
				l.outputTokens = max(l.outputTokens, 0) + tokensSent(choice)
			}
			if rs.bidi != nil {
				generated[string(index)] += int(tokensSent(choice))
				if reason := lookup(choice, "finish_reason"); truthy(reason) {
					ended[string(index)] = heldFinishReasons[string(reason)]
				}
			}
			pipeline := byIndex[string(index)]
			if pipeline == nil {
				pipeline = p.startPipeline(ctx, rs, index, out)
				byIndex[string(index)] = pipeline
				pipelines = append(pipelines, pipeline)
			}
			pipeline.push(next)
		}
	}
	if done && rs.bidi != nil { // decode finished these: with the KV pulled, it holds them now
		for index, held := range ended {
			if held {
				rs.bidi.held = append(rs.bidi.held, rs.count+generated[index])
			}
		}
	}
	finished := done && len(pipelines) > 0
	for _, pipeline := range pipelines {
		pipeline.mu.Lock()
		finished = finished && pipeline.finished
		pipeline.mu.Unlock()
	}
	if !finished && broke == "" {
		broke = "decode closed it"
		if done {
			broke = "decode sent [DONE] before a finish_reason"
		}
	}
	// Flush what was generated before reporting anything, so chunks stay in order.
	var failed error
	for _, pipeline := range pipelines {
		if err := pipeline.close(); err != nil && failed == nil {
			failed = err
		}
	}
	if out.gone.Load() || r.Context().Err() != nil { // (the pipelines are done: nothing else touches out.served now)
		out.served.outcome = "client_gone"
		p.abort(decode, rs.id, rs.auth) // the client left: stop the engine's work for it
		return ""
	}
	if !finished {
		p.abort(decode, rs.id, rs.auth) // decode may still be generating (a stalled stream)
	}
	switch {
	case failed != nil:
		status := http.StatusBadGateway
		var f *failure
		if (errors.As(failed, &f) && f.timedOut && !f.final) || ctx.Err() != nil {
			status = http.StatusGatewayTimeout
		}
		out.served.outcome = "error_" + strconv.Itoa(status)
		out.event(streamError(status, "derender failed: "+failed.Error()))
	case !finished:
		status := 502
		if quiet.Load() != nil || ctx.Err() != nil {
			status = 504
		}
		out.served.outcome = "error_" + strconv.Itoa(status)
		out.write(streamError(status, "decode stream ended before the answer was complete: "+broke), false, false)
	case usage != nil && usageAsked:
		object := `"text_completion"`
		if rs.chat {
			object = `"chat.completion.chunk"`
		}
		out.write(fmt.Appendf(nil, `{"id":%s,"object":%s,"created":%d,"model":%s,"choices":[],"usage":%s}`,
			rs.quotedID, object, time.Now().Unix(), rs.model, usage), false, false)
	}
	// The trailer events and [DONE] go out with the stream's end, in the server's last write.
	out.write([]byte("[DONE]"), false, false)
	return ""
}

// eventPiece: one event's tokens of a choice, the stop token that ended it dropped (vLLM
// keeps it in token_ids; `vllm serve` leaves it out of the text).
func eventPiece(choice []member, includeStop bool) (piece, bool) {
	tokens := lookup(choice, "token_ids")
	var ids []byte
	if tokens != nil && string(tokens) != "null" {
		elements, err := arrayElements(tokens)
		if err != nil {
			return piece{}, false
		}
		end := len(elements)
		if endsOnStopToken(choice, includeStop) && end > 0 {
			end--
		}
		if end > 0 {
			ids = tokens[elements[0].start:elements[end-1].end]
		}
	}
	next := piece{ids: append([]byte(nil), ids...)}
	if finish := lookup(choice, "finish_reason"); finish != nil && string(finish) != "null" {
		next.finish = append([]byte(nil), finish...)
		next.stop = stopStringOf(choice, includeStop)
	}
	return next, true
}

// stopStringOf: the stop string that ended a generate choice, when the text must end before it
// (vllm/protocol.py stop_string_of): finish_reason "stop" with a string stop_reason, unless
// include_stop_str_in_output; "" otherwise.
func stopStringOf(choice []member, includeStop bool) string {
	var stop string
	if includeStop || string(lookup(choice, "finish_reason")) != `"stop"` ||
		json.Unmarshal(lookup(choice, "stop_reason"), &stop) != nil {
		return ""
	}
	return stop
}

// endsOnStopToken: finished on an EOS or a stop_token_ids hit (its stop_reason is no string),
// which the text must not show unless include_stop_str_in_output.
func endsOnStopToken(choice []member, includeStop bool) bool {
	reason := lookup(choice, "stop_reason")
	return string(lookup(choice, "finish_reason")) == `"stop"` && !includeStop &&
		(len(reason) == 0 || reason[0] != '"')
}

func streamError(status int, message string) []byte {
	kind := "UpstreamError"
	if status == 504 {
		kind = "GatewayTimeout"
	}
	return errorBody(status, kind, withoutAddresses(message), "")
}

func streamBreak(ctx context.Context, quiet *atomic.Value) string {
	if why, ok := quiet.Load().(string); ok {
		return "decode stream timed out: " + why
	}
	return streamBroke(ctx)
}

// readLine: one line of the stream, however long.
func readLine(reader *bufio.Reader, into []byte) ([]byte, error) {
	for {
		part, err := reader.ReadSlice('\n')
		into = append(into, part...)
		if err != bufio.ErrBufferFull {
			return into, err
		}
	}
}
