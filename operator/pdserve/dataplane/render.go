package main

// The render route: engines behind render servers (token ids in, token ids out), served
// render -> (prefill ->) decode -> derender, streamed (render_stream.go) or not. The calls, bodies and corrections
// are the Python gateway's (gateway/tokens_route.py, vllm/protocol.py, vllm/derender_gaps.py);
// each body is spliced from the bytes it came in, so the prompt's token ids are copied, never
// decoded into numbers and encoded again.

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
)

const generatePath = "/inference/v1/generate"

func renderPath(chat bool) string {
	if chat {
		return "/v1/chat/completions/render"
	}
	return "/v1/completions/render"
}

func derenderPath(chat bool) string {
	if chat {
		return "/v1/chat/completions/derender"
	}
	return "/v1/completions/derender"
}

// What the rendered generate request must not keep when the route sets it.
var (
	tokensPrefillDrops = map[string]bool{"request_id": true, "stream": true,
		"stream_options": true, "sampling_params": true, "kv_transfer_params": true}
	tokensDecodeDrops = map[string]bool{"request_id": true, "sampling_params": true,
		"kv_transfer_params": true}
	prefillParamDrops = map[string]bool{"max_tokens": true, "min_tokens": true, "n": true,
		"extra_args": true}
	extraArgsDrops   = map[string]bool{"extra_args": true}
	kvParamsDrops    = map[string]bool{"kv_transfer_params": true}
	answerFixedDrops = map[string]bool{"id": true, "model": true, "usage": true}
	tokenIDsDrops    = map[string]bool{"token_ids": true}
	choicesDrops     = map[string]bool{"choices": true}
)

// requestClass is what the client declared (X-PDServe-Class), or auto: by prompt length.
type requestClass int

const (
	classAuto requestClass = iota
	classLong
	classShort
)

func (c requestClass) long(auto bool) bool {
	return c == classLong || (c == classAuto && auto)
}

// rendered serves one request on a model behind render servers. Once render has it, nothing
// is handed over: its failures are answered here with the Python gateway's retries,
// fallbacks and words (tokens_route.py; failures.go).
func (p *plane) rendered(ctx context.Context, w http.ResponseWriter, r *http.Request, t *table,
	m *model, body []byte, members []member, class requestClass, id, auth string, stream bool,
	s *served) fallback {
	chat := r.URL.Path == "/v1/chat/completions"
	renderAnswer := p.buffers.Get().(*bytes.Buffer)
	defer p.buffers.Put(renderAnswer)
	renderer, f := p.renderJSON(ctx, m, "render", renderPath(chat), body, id, auth, renderAnswer)
	if f != nil {
		return p.failed(w, s, f)
	}
	s.ran("render", renderer)
	generate, ok := onePrompt(renderAnswer.Bytes())
	if !ok {
		f := gatewayError(http.StatusBadRequest, "BadRequestError", "send one prompt per request")
		f.param = "prompt"
		return p.failed(w, s, f)
	}
	fields, err := topLevel(generate)
	generate, fields = withRenderedLimit(generate, fields)
	tokens, params := lookup(fields, "token_ids"), lookup(fields, "sampling_params")
	paramFields, paramErr := topLevel(params)
	if err != nil || len(tokens) < 2 || tokens[0] != '[' || paramErr != nil {
		return p.failed(w, s, gatewayError(http.StatusBadGateway, "UpstreamError", "render answered without token ids"))
	}
	promptTokens := countElements(tokens)
	if s.log != nil {
		s.log.promptTokens = int64(promptTokens) // what a stream's entry says (tokens_route.py)
	}
	if s.where != nil {
		s.where.hashes, _ = blockHashes(tokens, m.blockSize) // none: picked by load alone
	}
	prefill, decode := p.route(m, int64(promptTokens), s)
	var bidi *bidiRequest
	kvParams := handoff
	if m.bidi != nil && prefill != nil {
		conversation := conversationOf(lookup(members, "conversation_id"), r.Header.Get("X-Conversation-Id"))
		var narrowed *model
		if narrowed, bidi = p.holdRoom(m, paramFields, promptTokens, id, conversation); bidi == nil {
			prefill, decode = nil, s.where.pick("decode", m.decodes, true) // holds nothing
		} else {
			routed := m
			defer func() { p.settle(routed, bidi) }()
			m, kvParams = p.handoff(narrowed, bidi, tokens, s)
			prefill, decode = m.repick(s)
		}
	}
	release := func() {}
	if class.long(t.longTokens > 0 && int64(promptTokens) >= t.longTokens) && prefill != nil {
		var granted *endpoint
		var reason fallback
		if granted, release, reason = p.admit(ctx, t, m, prefill, s); reason != "" {
			return reason
		}
		prefill, decode = granted, m.decodeFor(granted, s.where)
	}
	quotedID := strconv.AppendQuote(nil, id)
	var kv []byte
	if prefill != nil {
		kv, decode, f = p.prefillTokens(ctx, m, prefill, decode, generate, fields, params, paramFields, kvParams, quotedID, id, auth, release, s)
		if f != nil {
			return p.failed(w, s, f)
		}
		if kv != nil && bidi != nil {
			p.prefilled(bidi)
		}
	}
	request := p.buffers.Get().(*bytes.Buffer)
	defer p.buffers.Put(request)
	request.Reset()
	s.kvToDecode = kv != nil
	tokensDecodeBody(request, generate, fields, params, paramFields, quotedID, kv)
	includeStop := string(lookup(paramFields, "include_stop_str_in_output")) == "true"
	s.route = routeRenderDecode
	if prefill != nil {
		s.route = routeRenderPD
	}
	local := func(into *bytes.Buffer) []byte { // without prefill's KV: decode prefills itself
		into.Reset()
		tokensDecodeBody(into, generate, fields, params, paramFields, quotedID, nil)
		return into.Bytes()
	}
	if kv == nil {
		local = nil
	} else if !stream && p.leaseRanOut(m, s, true, id, auth) {
		local(request)
		local = nil
	}
	if stream {
		rs := &rendering{chat: chat, model: lookup(members, "model"), quotedID: quotedID, id: id,
			auth: auth, tokens: tokens, count: promptTokens, request: body,
			pipelining: t.derenderPipelining, renderer: renderer, routed: m, includeStop: includeStop,
			stopHold: stopHold(members), served: s, bidi: bidi}
		reason := p.streamRendered(ctx, w, r, rs, decode, request.Bytes(), local, usageAsked(members))
		if reason == "" {
			p.countRendered(prefill != nil)
		}
		return reason
	}
	decoded := p.buffers.Get().(*bytes.Buffer)
	defer p.buffers.Put(decoded)
	decodedOn, f := p.decodeOnce(ctx, m, decode, generatePath, request.Bytes(), local, id, auth, decoded, s)
	if f != nil {
		if f == errClientLeft {
			p.abort(decode, id, auth) // a tokens engine behind a proxy may keep working else
		}
		return p.failed(w, s, f)
	}
	s.ran("decode", decodedOn)
	answer := decoded.Bytes()
	answerFields, err := topLevel(answer)
	if err != nil || !allObjects(lookup(answerFields, "choices")) {
		return p.failed(w, s, noChoices)
	}
	if bidi != nil {
		bidi.decodedOn, bidi.pulled = decodedOn, s.kvToDecode
		p.answered(m, bidi, answerFields, tokens, promptTokens)
	}
	trimmed := p.buffers.Get().(*bytes.Buffer)
	defer p.buffers.Put(trimmed)
	generated, stops := withoutStopTokens(trimmed, answer, answerFields, includeStop)
	request.Reset()
	derenderBody(request, chat, lookup(members, "model"), generated, promptTokens, tokens, body)
	derendered := p.buffers.Get().(*bytes.Buffer)
	defer p.buffers.Put(derendered)
	if _, f := p.renderJSON(ctx, m, "derender", derenderPath(chat), request.Bytes(), id, auth, derendered); f != nil {
		return p.failed(w, s, f)
	}
	result, err := topLevel(derendered.Bytes())
	if err != nil || !hasChoices(lookup(result, "choices")) {
		return p.failed(w, s, gatewayError(http.StatusBadGateway, "UpstreamError", "derender answered without choices"))
	}
	final := p.buffers.Get().(*bytes.Buffer)
	defer p.buffers.Put(final)
	toolChoice := lookup(members, "tool_choice")
	namedTool := len(toolChoice) > 0 && toolChoice[0] == '{'
	matchVllmServe(final, derendered.Bytes(), result, lookup(answerFields, "usage"), stops,
		chat, namedTool, lookup(members, "model"), quotedID)
	p.countRendered(prefill != nil)
	if s.log != nil {
		s.log.promptTokens = -1 // the answer's usage says, as the Python gateway's entry does
		s.log.usage(final.Bytes())
	}
	nameResponse(w.Header(), r, id)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(final.Len()))
	s.answered()
	if _, err := w.Write(final.Bytes()); err != nil {
		s.outcome = "client_gone"
	}
	return ""
}

var requestIDDrops = map[string]bool{"request_id": true}

func (p *plane) countRendered(pd bool) {
	if pd {
		p.stats.renderPD.Add(1)
	} else {
		p.stats.renderDecode.Add(1)
	}
}

// usageAsked: the client's stream_options.include_usage.
func usageAsked(members []member) bool {
	options, err := topLevel(lookup(members, "stream_options"))
	return err == nil && string(lookup(options, "include_usage")) == "true"
}

// renderJSON is post_json to the model's render servers (the least loaded first), each call's
// time measured per server and stage (render, derender), whatever its answer: the render
// autoscaler reads it as the server's busy time; answered, it is that stage's latency too.
func (p *plane) renderJSON(ctx context.Context, m *model, stage, path string, body []byte,
	id, auth string, into *bytes.Buffer) (*endpoint, *failure) {
	first := least(m.render)
	served, f := p.callJSON(ctx, stage, []*endpoint{first}, path, body, id, auth, p.timeouts.render, false, 0, into)
	if f != nil && !f.final && len(m.render) > 1 {
		others := make([]*endpoint, 0, len(m.render)-1)
		for _, e := range m.render {
			if e != first {
				others = append(others, e)
			}
		}
		served, f = p.callJSON(ctx, stage, others, path, body, id, auth, p.timeouts.render, false, 0, into)
	}
	return served, f
}

// prefillTokens runs the prefill of a rendered request: cut to one token, one choice, not
// streamed, with the handoff's kv_transfer_params (also in sampling_params.extra_args, which
// older engines read). Its kv_transfer_params come back; nil when decode prefills itself
// (prefillCall).
func (p *plane) prefillTokens(ctx context.Context, m *model, e, decode *endpoint, generate []byte, fields []member,
	params []byte, paramFields []member, handoff, quotedID []byte, id, auth string, release func(), s *served) ([]byte, *endpoint, *failure) {
	request := p.buffers.Get().(*bytes.Buffer)
	defer p.buffers.Put(request)
	request.Reset()
	tokensPrefillBody(request, generate, fields, params, paramFields, handoff, quotedID)
	return p.prefillCall(ctx, m, e, decode, generatePath, request.Bytes(), id, auth, release, s)
}

// tokensPrefillBody is protocol.tokens_prefill_body: the rendered generate request cut to
// prefill only (one token, one choice, not streamed), with the handoff's kv_transfer_params
// (also in sampling_params.extra_args, which older engines read), named by the gateway's id.
func tokensPrefillBody(dst *bytes.Buffer, generate []byte, fields []member, params []byte,
	paramFields []member, handoff, quotedID []byte) {
	cut := withExtraArg(params, paramFields, prefillParamDrops,
		[]field{{"max_tokens", []byte("1")}, {"min_tokens", []byte("0")}, {"n", []byte("1")}}, handoff)
	splice(dst, generate, fields, tokensPrefillDrops, []field{{"request_id", quotedID},
		{"stream", []byte("false")}, {"stream_options", []byte("null")},
		{"sampling_params", cut}, {"kv_transfer_params", handoff}})
}

// tokensDecodeBody is protocol.tokens_decode_body: the rendered generate request named by the
// gateway's id, pulling prefill's KV when kv is given (also in sampling_params.extra_args),
// else as rendered (decode prefills itself).
func tokensDecodeBody(dst *bytes.Buffer, generate []byte, fields []member, params []byte,
	paramFields []member, quotedID, kv []byte) {
	extra := []field{{"request_id", quotedID}}
	if kv == nil {
		splice(dst, generate, fields, requestIDDrops, extra)
		return
	}
	extra = append(extra, field{"kv_transfer_params", kv},
		field{"sampling_params", withExtraArg(params, paramFields, extraArgsDrops, nil, kv)})
	splice(dst, generate, fields, tokensDecodeDrops, extra)
}

// withExtraArg: sampling params without `drop`, with `extra`, and extra_args carrying
// kv_transfer_params = kv (the rest of extra_args kept).
func withExtraArg(params []byte, fields []member, drop map[string]bool, extra []field, kv []byte) []byte {
	var args bytes.Buffer
	existing := lookup(fields, "extra_args")
	argFields, err := topLevel(existing)
	if len(existing) > 0 && existing[0] == '{' && err == nil {
		splice(&args, existing, argFields, kvParamsDrops, []field{{"kv_transfer_params", kv}})
	} else {
		splice(&args, nil, nil, nil, []field{{"kv_transfer_params", kv}})
	}
	var out bytes.Buffer
	splice(&out, params, fields, drop, append(extra, field{"extra_args", args.Bytes()}))
	return out.Bytes()
}

// samplingDefaultMaxTokens is vLLM's SamplingParams.max_tokens default, which its render server
// leaves out of the sampling params it answers (msgspec's omit_defaults; vLLM 0.32).
var samplingDefaultMaxTokens = []byte("16")

var samplingParamsDrops = map[string]bool{"sampling_params": true}

// withRenderedLimit: the rendered generate request with the output limit render resolved written
// out (protocol.py with_rendered_limit). Render resolves every request's max_tokens as vLLM's
// own chat endpoint does, then leaves a 16 out as SamplingParams' default; a tokens engine reads
// a missing max_tokens as not given and generates up to the whole context left. Absent can only
// mean 16, so it is written back: the client's own number would skip render's caps. A generate
// request that holds a limit, or is not the shape the route reads, comes back as it was.
func withRenderedLimit(generate []byte, fields []member) ([]byte, []member) {
	params := lookup(fields, "sampling_params")
	paramFields, err := topLevel(params)
	if err != nil || lookup(paramFields, "max_tokens") != nil {
		return generate, fields
	}
	var limited, out bytes.Buffer
	splice(&limited, params, paramFields, nil, []field{{"max_tokens", samplingDefaultMaxTokens}})
	splice(&out, generate, fields, samplingParamsDrops, []field{{"sampling_params", limited.Bytes()}})
	written, err := topLevel(out.Bytes())
	if err != nil {
		return generate, fields
	}
	return out.Bytes(), written
}

// onePrompt: the generate request render answered (completions render answers a list of them;
// the route takes one prompt per request).
func onePrompt(answer []byte) ([]byte, bool) {
	start := skipSpace(answer, 0)
	if start >= len(answer) || answer[start] != '[' {
		return answer, true
	}
	list := answer[start:]
	elements, err := arrayElements(list)
	if err != nil || len(elements) != 1 {
		return nil, false
	}
	return list[elements[0].start:elements[0].end], true
}

// span is one element of a JSON array: raw[start:end].
type span struct{ start, end int }

// arrayElements: each element of a JSON array, as spans of `raw`.
func arrayElements(raw []byte) ([]span, error) {
	i := skipSpace(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return nil, errNotObject
	}
	elements := []span{}
	i = skipSpace(raw, i+1)
	if i < len(raw) && raw[i] == ']' {
		return elements, nil
	}
	for {
		end, err := valueEnd(raw, i)
		if err != nil {
			return nil, err
		}
		elements = append(elements, span{i, end})
		i = skipSpace(raw, end)
		if i >= len(raw) {
			return nil, errNotObject
		}
		if raw[i] == ']' {
			return elements, nil
		}
		if raw[i] != ',' {
			return nil, errNotObject
		}
		i = skipSpace(raw, i+1)
	}
}

// countElements: how many numbers a flat array of numbers holds (a token id list).
func countElements(tokens []byte) int {
	if bytes.IndexFunc(tokens[1:len(tokens)-1], func(r rune) bool { return r != ' ' && r != '\n' && r != '\t' && r != '\r' }) < 0 {
		return 0
	}
	return bytes.Count(tokens, []byte{','}) + 1
}

// hasChoices: a non-empty array of objects, what a client's answer is made of.
func hasChoices(raw []byte) bool {
	elements, err := arrayElements(raw)
	if err != nil || len(elements) == 0 {
		return false
	}
	for _, e := range elements {
		if raw[e.start] != '{' {
			return false
		}
	}
	return true
}

// withoutStopTokens writes the decode answer with each choice's ending stop token dropped
// (vLLM keeps an EOS or a stop_token_ids hit in token_ids; `vllm serve` leaves it out of the
// text) into `dst`, and says, by choice index, the stop string that ended a choice when the
// text must end before it. The answer's own bytes come back when nothing changed.
func withoutStopTokens(dst *bytes.Buffer, answer []byte, fields []member, includeStop bool) ([]byte, map[string]string) {
	dst.Reset()
	var stops map[string]string
	list := lookup(fields, "choices")
	choices, _ := arrayElements(list)
	changed := false
	rewritten := make([][]byte, len(choices))
	for i, at := range choices {
		choice := list[at.start:at.end]
		rewritten[i] = choice
		members, err := topLevel(choice)
		if err != nil || string(lookup(members, "finish_reason")) != `"stop"` || includeStop {
			continue
		}
		if reason := lookup(members, "stop_reason"); len(reason) > 0 && reason[0] == '"' {
			if stop := stopStringOf(members, includeStop); stop != "" {
				if stops == nil {
					stops = map[string]string{}
				}
				stops[indexOf(members)] = stop
			}
			continue
		}
		tokens := lookup(members, "token_ids")
		ids, err := arrayElements(tokens)
		if err != nil || len(ids) == 0 {
			continue
		}
		kept := []byte("[]")
		if len(ids) > 1 {
			kept = append(append([]byte{'['}, tokens[ids[0].start:ids[len(ids)-2].end]...), ']')
		}
		var out bytes.Buffer
		splice(&out, choice, members, tokenIDsDrops, []field{{"token_ids", kept}})
		rewritten[i] = out.Bytes()
		changed = true
	}
	if !changed {
		return answer, stops
	}
	var joined bytes.Buffer
	joined.WriteByte('[')
	for i, choice := range rewritten {
		if i > 0 {
			joined.WriteByte(',')
		}
		joined.Write(choice)
	}
	joined.WriteByte(']')
	splice(dst, answer, fields, choicesDrops, []field{{"choices", joined.Bytes()}})
	return dst.Bytes(), stops
}

// indexOf: a choice's index as written ("0" when it has none).
func indexOf(members []member) string {
	if index := lookup(members, "index"); index != nil {
		return string(index)
	}
	return "0"
}

// derenderBody: the decode answer turned back into the client's answer by the render server
// that rendered it, with the client's request (its parsers need it).
func derenderBody(dst *bytes.Buffer, chat bool, model, answer []byte, promptTokens int,
	tokens, request []byte) {
	dst.Grow(len(answer) + len(tokens) + len(request) + 256)
	dst.WriteString(`{"stream":false,"model":`)
	dst.Write(model)
	count := strconv.Itoa(promptTokens)
	if chat {
		dst.WriteString(`,"generate_response":`)
		dst.Write(answer)
		dst.WriteString(`,"prompt_tokens":` + count + `,"prompt_token_ids":`)
		dst.Write(tokens)
		dst.WriteString(`,"chat_request":`)
	} else {
		dst.WriteString(`,"generate_responses":[`)
		dst.Write(answer)
		dst.WriteString(`],"prompt_tokens":[` + count + `],"prompt_token_ids":[`)
		dst.Write(tokens)
		dst.WriteString(`],"completion_request":`)
	}
	dst.Write(request)
	dst.WriteByte('}')
}

// matchVllmServe writes the derendered answer as `vllm serve` would have answered: the
// engine's usage (the stop token counted), text ended where a stop string starts, a chat
// answer whose tool calls were parsed ending with finish_reason "tool_calls" (unless the
// request named the function), and the gateway's id and the model's name.
func matchVllmServe(dst *bytes.Buffer, result []byte, fields []member, usage []byte,
	stops map[string]string, chat, namedTool bool, model, quotedID []byte) {
	dst.Reset()
	choices := lookup(fields, "choices")
	toolCalls := chat && !namedTool && bytes.Contains(choices, []byte(`"tool_calls"`))
	drop := answerFixedDrops
	extra := []field{{"id", quotedID}, {"model", model}}
	if len(usage) > 0 && usage[0] == '{' {
		extra = append(extra, field{"usage", usage})
	} else {
		drop = map[string]bool{"id": true, "model": true}
	}
	if len(stops) > 0 || toolCalls {
		extra = append(extra, field{"choices", fixChoices(choices, stops, chat, toolCalls)})
		drop = withKey(drop, "choices")
	}
	splice(dst, result, fields, drop, extra)
}

func withKey(set map[string]bool, key string) map[string]bool {
	out := map[string]bool{key: true}
	for k := range set {
		out[k] = true
	}
	return out
}

func fixChoices(choices []byte, stops map[string]string, chat, toolCalls bool) []byte {
	elements, _ := arrayElements(choices)
	var list bytes.Buffer
	list.WriteByte('[')
	for i, at := range elements {
		choice := choices[at.start:at.end]
		if i > 0 {
			list.WriteByte(',')
		}
		members, err := topLevel(choice)
		if err != nil {
			list.Write(choice)
			continue
		}
		stop, hasStop := stops[indexOf(members)]
		var out bytes.Buffer
		switch {
		case chat:
			message := lookup(members, "message")
			messageFields, err := topLevel(message)
			if err != nil {
				list.Write(choice)
				continue
			}
			fixed := message
			if hasStop {
				fixed = cutMessage(message, messageFields, stop)
			}
			drop, extra := map[string]bool{"message": true}, []field{{"message", fixed}}
			calls := lookup(messageFields, "tool_calls")
			if toolCalls && string(lookup(members, "finish_reason")) == `"stop"` {
				if called, err := arrayElements(calls); err == nil && len(called) > 0 {
					drop = withKey(drop, "finish_reason")
					extra = append(extra, field{"finish_reason", []byte(`"tool_calls"`)})
				}
			}
			splice(&out, choice, members, drop, extra)
		case hasStop:
			cut, found := cutString(lookup(members, "text"), stop)
			if !found {
				list.Write(choice)
				continue
			}
			splice(&out, choice, members, map[string]bool{"text": true}, []field{{"text", cut}})
		default:
			list.Write(choice)
			continue
		}
		list.Write(out.Bytes())
	}
	list.WriteByte(']')
	return list.Bytes()
}

// cutMessage ends the generated text where the stop string starts: in the reasoning (then
// there is no content) or in the content.
func cutMessage(message []byte, fields []member, stop string) []byte {
	var out bytes.Buffer
	if reasoning := lookup(fields, "reasoning"); len(reasoning) > 0 && reasoning[0] == '"' {
		if cut, found := cutString(reasoning, stop); found {
			splice(&out, message, fields, map[string]bool{"reasoning": true, "content": true},
				[]field{{"reasoning", cut}, {"content", []byte("null")}})
			return out.Bytes()
		}
	}
	cut, found := cutString(lookup(fields, "content"), stop)
	if !found {
		return message
	}
	splice(&out, message, fields, map[string]bool{"content": true}, []field{{"content", cut}})
	return out.Bytes()
}

// cutString: a JSON string value cut where `stop` starts; false when it is not a string or
// holds no `stop` (then it stays as it is).
func cutString(raw []byte, stop string) ([]byte, bool) {
	if len(raw) == 0 || raw[0] != '"' {
		return nil, false
	}
	var text string
	if json.Unmarshal(raw, &text) != nil {
		return nil, false
	}
	at := strings.Index(text, stop)
	if at < 0 {
		return nil, false
	}
	var out bytes.Buffer
	encoder := json.NewEncoder(&out)
	encoder.SetEscapeHTML(false)
	_ = encoder.Encode(text[:at])
	return bytes.TrimRight(out.Bytes(), "\n"), true
}

// nameResponse: the gateway's own id of the request (X-PDServe-Request-Id, what the engines
// were told) and the client's X-Request-Id back, as the Python gateway names every answer.
func nameResponse(h http.Header, r *http.Request, id string) {
	nameAnswer(h, id, r.Header.Get("X-Request-Id"))
}

// nameAnswer is nameResponse from the ids alone (echo_request_id: every answer names its
// request, an error answer too).
func nameAnswer(h http.Header, id, client string) {
	h.Set("X-PDServe-Request-Id", id)
	if client != "" && len(client) <= 256 && printable(client) {
		h.Set("X-Request-Id", client)
	}
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
