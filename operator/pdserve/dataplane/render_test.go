package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

func parsed(t *testing.T, raw []byte) any {
	t.Helper()
	var value any
	if err := json.Unmarshal(raw, &value); err != nil {
		t.Fatalf("not JSON: %v: %s", err, raw)
	}
	return value
}

func sameJSON(t *testing.T, got []byte, want string) {
	t.Helper()
	if !reflect.DeepEqual(parsed(t, got), parsed(t, []byte(want))) {
		t.Fatalf("got  %s\nwant %s", got, want)
	}
}

func TestTheStopTokenThatEndedAChoiceIsDroppedAndAStopStringNamed(t *testing.T) {
	answer := []byte(`{"request_id":"r","choices":[
		{"index":0,"token_ids":[5, 6, 151645],"finish_reason":"stop","stop_reason":null},
		{"index":1,"token_ids":[7],"finish_reason":"stop","stop_reason":151643},
		{"index":2,"token_ids":[8,9],"finish_reason":"length","stop_reason":null},
		{"index":3,"token_ids":[10,11],"finish_reason":"stop","stop_reason":"</x>"}],
		"usage":{"prompt_tokens":3,"completion_tokens":8,"total_tokens":11}}`)
	fields, _ := topLevel(answer)
	var dst bytes.Buffer
	trimmed, stops := withoutStopTokens(&dst, answer, fields, false)
	sameJSON(t, trimmed, `{"request_id":"r","choices":[
		{"index":0,"token_ids":[5,6],"finish_reason":"stop","stop_reason":null},
		{"index":1,"token_ids":[],"finish_reason":"stop","stop_reason":151643},
		{"index":2,"token_ids":[8,9],"finish_reason":"length","stop_reason":null},
		{"index":3,"token_ids":[10,11],"finish_reason":"stop","stop_reason":"</x>"}],
		"usage":{"prompt_tokens":3,"completion_tokens":8,"total_tokens":11}}`)
	if !reflect.DeepEqual(stops, map[string]string{"3": "</x>"}) {
		t.Fatalf("stops %v", stops)
	}
	// include_stop_str_in_output: the text keeps what ended it, as `vllm serve` does.
	kept, stops := withoutStopTokens(&dst, answer, fields, true)
	if !bytes.Equal(kept, answer) || stops != nil {
		t.Fatalf("changed with include_stop_str_in_output: %s %v", kept, stops)
	}
}

func TestTheDerenderedAnswerIsCorrectedAsVllmServeWouldAnswer(t *testing.T) {
	result := []byte(`{"id":"chatcmpl-render","object":"chat.completion","model":"served",
		"choices":[
		{"index":0,"message":{"role":"assistant","content":"a \u003cb\u003e</x>tail"},"finish_reason":"stop"},
		{"index":1,"message":{"role":"assistant","reasoning":"think</x>more","content":"c"},"finish_reason":"stop"},
		{"index":2,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"t"}]},"finish_reason":"stop"},
		{"index":3,"message":{"role":"assistant","content":"d","tool_calls":[]},"finish_reason":"stop"}],
		"usage":{"prompt_tokens":3,"completion_tokens":7,"total_tokens":10}}`)
	fields, _ := topLevel(result)
	usage := []byte(`{"prompt_tokens":3,"completion_tokens":8,"total_tokens":11}`)
	stops := map[string]string{"0": "</x>", "1": "</x>"}
	var dst bytes.Buffer
	matchVllmServe(&dst, result, fields, usage, stops, true, false, []byte(`"qwen"`), []byte(`"pdserve-1"`))
	sameJSON(t, dst.Bytes(), `{"id":"pdserve-1","object":"chat.completion","model":"qwen",
		"choices":[
		{"index":0,"message":{"role":"assistant","content":"a <b>"},"finish_reason":"stop"},
		{"index":1,"message":{"role":"assistant","reasoning":"think","content":null},"finish_reason":"stop"},
		{"index":2,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"t"}]},"finish_reason":"tool_calls"},
		{"index":3,"message":{"role":"assistant","content":"d","tool_calls":[]},"finish_reason":"stop"}],
		"usage":{"prompt_tokens":3,"completion_tokens":8,"total_tokens":11}}`)
	// A request that named its function keeps "stop" (as `vllm serve` does).
	matchVllmServe(&dst, result, fields, usage, nil, true, true, []byte(`"qwen"`), []byte(`"pdserve-1"`))
	if !strings.Contains(dst.String(), `"tool_calls":[{"id":"t"}]},"finish_reason":"stop"`) {
		t.Fatalf("named tool: %s", dst.String())
	}
	completion := []byte(`{"id":"cmpl-r","choices":[{"index":0,"text":"once</x>upon"}],"usage":null}`)
	fields, _ = topLevel(completion)
	matchVllmServe(&dst, completion, fields, nil, map[string]string{"0": "</x>"}, false, false,
		[]byte(`"qwen"`), []byte(`"pdserve-2"`))
	sameJSON(t, dst.Bytes(), `{"id":"pdserve-2","model":"qwen","choices":[{"index":0,"text":"once"}],"usage":null}`)
}

func TestARenderedPromptIsOneGenerateRequestWithItsTokensCounted(t *testing.T) {
	if got, ok := onePrompt([]byte(` [{"token_ids":[1]}]`)); !ok || string(got) != `{"token_ids":[1]}` {
		t.Fatalf("list of one: %s %v", got, ok)
	}
	if _, ok := onePrompt([]byte(`[{"a":1},{"a":2}]`)); ok {
		t.Fatal("two prompts taken")
	}
	for raw, want := range map[string]int{`[]`: 0, `[ ]`: 0, `[7]`: 1, `[1, 2,3]`: 3} {
		if got := countElements([]byte(raw)); got != want {
			t.Fatalf("countElements(%s) = %d, want %d", raw, got, want)
		}
	}
}

func TestExtraArgsCarryTheKvTransferParamsBesideWhatTheyHeld(t *testing.T) {
	params := []byte(`{"max_tokens":64,"n":2,"extra_args":{"mine":1,"kv_transfer_params":{"old":1}}}`)
	fields, _ := topLevel(params)
	cut := withExtraArg(params, fields, prefillParamDrops,
		[]field{{"max_tokens", []byte("1")}, {"min_tokens", []byte("0")}, {"n", []byte("1")}}, handoff)
	sameJSON(t, cut, `{"max_tokens":1,"min_tokens":0,"n":1,"extra_args":{"mine":1,"kv_transfer_params":`+string(handoff)+`}}`)
	bare := []byte(`{"max_tokens":64,"extra_args":null}`)
	fields, _ = topLevel(bare)
	sameJSON(t, withExtraArg(bare, fields, extraArgsDrops, nil, []byte(`{"k":1}`)),
		`{"max_tokens":64,"extra_args":{"kv_transfer_params":{"k":1}}}`)
}

// renderedLimitCase: one of testdata/rendered_limit_cases.json, which the Python gateway's own
// test (tests/unit/gateway/test_rendered_limit_cases.py) reads too: render's sampling params,
// and those the engine must get.
type renderedLimitCase struct {
	Name     string          `json:"name"`
	Rendered json.RawMessage `json:"rendered"`
	Engine   json.RawMessage `json:"engine"`
}

func TestTheEngineGetsTheLimitRenderResolvedEvenWhereRenderLeftItOut(t *testing.T) {
	for _, c := range sharedCases[[]renderedLimitCase](t, "rendered_limit_cases.json") {
		generate := []byte(`{"request_id":"chatcmpl-1","token_ids":[1, 2,3],"sampling_params":` +
			string(c.Rendered) + `,"stream":false}`)
		fields, err := topLevel(generate)
		if err != nil {
			t.Fatalf("%s: %v", c.Name, err)
		}
		got, gotFields := withRenderedLimit(generate, fields)
		want := `{"request_id":"chatcmpl-1","token_ids":[1,2,3],"sampling_params":` +
			string(c.Engine) + `,"stream":false}`
		if !reflect.DeepEqual(parsed(t, got), parsed(t, []byte(want))) {
			t.Errorf("%s:\ngot  %s\nwant %s", c.Name, got, want)
		}
		if string(lookup(gotFields, "token_ids")) != "[1, 2,3]" {
			t.Errorf("%s: the prompt's token ids were rewritten: %s", c.Name, lookup(gotFields, "token_ids"))
		}
	}
	for _, odd := range []string{`{"token_ids":[1]}`, `{"token_ids":[1],"sampling_params":null}`} {
		fields, _ := topLevel([]byte(odd))
		if got, _ := withRenderedLimit([]byte(odd), fields); string(got) != odd {
			t.Errorf("%s rewritten as %s: the route answers 502 for it", odd, got)
		}
	}
}

// renderStack: a render server and a tokens engine (prefill and decode alike) that record the
// bodies they were sent.
type renderStack struct {
	mu   sync.Mutex
	sent map[string][]any // path -> bodies
}

func (s *renderStack) handler(t *testing.T) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		body := parsed(t, raw).(map[string]any)
		s.mu.Lock()
		s.sent[r.URL.Path] = append(s.sent[r.URL.Path], body)
		s.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/v1/chat/completions/render":
			fmt.Fprintf(w, `{"request_id":"chatcmpl-x","token_ids":[1,2,3],"features":null,
				"sampling_params":{"max_tokens":8,"n":1,"extra_args":null},"stream":%v,
				"stream_options":null,"kv_transfer_params":null}`, body["stream"] == true)
		case generatePath:
			if body["stream"] == true {
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"token_ids\":[7],\"finish_reason\":null}]}\n\n")
				io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"token_ids\":[8,0],\"finish_reason\":\"stop\",\"stop_reason\":null}]}\n\n")
				io.WriteString(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":3,\"total_tokens\":6}}\n\ndata: [DONE]\n\n")
				return
			}
			if body["sampling_params"].(map[string]any)["max_tokens"] == 1.0 {
				io.WriteString(w, `{"request_id":"p","choices":[{"index":0,"token_ids":[9]}],"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[4]}}`)
				return
			}
			io.WriteString(w, `{"request_id":"d","choices":[{"index":0,"token_ids":[7,8,0],"finish_reason":"stop","stop_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}`)
		case "/v1/chat/completions/derender":
			if body["stream"] == true {
				choice := body["generate_chunk"].(map[string]any)["choices"].([]any)[0].(map[string]any)
				seen := 0.0
				if state, ok := body["stream_state"].(map[string]any); ok {
					seen = state["seen"].(float64)
				}
				ids := choice["token_ids"].([]any)
				finish, _ := json.Marshal(choice["finish_reason"])
				fmt.Fprintf(w, `{"chunk":{"id":"x","object":"chat.completion.chunk","model":"served","choices":[{"index":0,"delta":{"content":%q},"finish_reason":%s}]},"stream_state":{"seen":%v}}`,
					strings.Repeat("t", len(ids)), finish, seen+float64(len(ids)))
				return
			}
			io.WriteString(w, `{"id":"chatcmpl-x","object":"chat.completion","model":"qwen","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}`)
		default:
			w.WriteHeader(http.StatusNotFound)
		}
	})
}

// renderPlane: a data plane serving `table` (URL: the renderStack's address) and the stack.
func renderPlane(t *testing.T, table string) (*renderStack, *plane, *table) {
	t.Helper()
	s := &renderStack{sent: map[string][]any{}}
	server := httptest.NewServer(s.handler(t))
	t.Cleanup(server.Close)
	p := &plane{upstream: newUpstreamPool(time.Second, 5*time.Second, 4*time.Second),
		maxBody: 1 << 20, maxInflight: 16, engines: map[string]*endpoint{},
		timeouts: timeouts{idle: 5 * time.Second, request: 10 * time.Second, render: 5 * time.Second},
		queue:    newFairQueue(), metrics: newServedMetrics([]float64{0.01, 1}, []float64{1, 2, 4})}
	p.buffers.New = func() any { return new(bytes.Buffer) }
	built, engines, err := build([]byte(strings.ReplaceAll(table, "URL", server.URL)), nil)
	if err != nil {
		t.Fatal(err)
	}
	p.engines = engines
	p.current.Store(built)
	return s, p, built
}

func TestTheRenderRouteSendsEachHopThePythonGatewaysBody(t *testing.T) {
	s, p, tbl := renderPlane(t, `{"version":1,"models":{"qwen":{"route":"pd","render":["URL"],
		"groups":[{"prefill":["URL"],"decode":["URL"]}]}}}`)
	client := `{"model":"qwen","messages":[{"role":"user","content":"hi"}]}`
	request := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(client))
	request.Header.Set("X-Request-Id", "mine")
	recorder := httptest.NewRecorder()
	p.serveCompletion(recorder, request)
	if recorder.Code != 200 {
		t.Fatalf("%d %s", recorder.Code, recorder.Body.String())
	}
	id := recorder.Header().Get("X-PDServe-Request-Id")
	if !strings.HasPrefix(id, "pdserve-") || recorder.Header().Get("X-Request-Id") != "mine" {
		t.Fatalf("headers %v", recorder.Header())
	}
	sameJSON(t, recorder.Body.Bytes(), `{"id":"`+id+`","object":"chat.completion","model":"qwen",
		"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],
		"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}`)
	handoffParams := parsed(t, handoff)
	kv := map[string]any{"remote_engine_id": "e", "remote_block_ids": []any{4.0}}
	want := map[string][]any{
		"/v1/chat/completions/render": {parsed(t, []byte(client))},
		generatePath: {
			map[string]any{"request_id": id, "token_ids": []any{1.0, 2.0, 3.0}, "features": nil,
				"stream": false, "stream_options": nil, "kv_transfer_params": handoffParams,
				"sampling_params": map[string]any{"max_tokens": 1.0, "min_tokens": 0.0, "n": 1.0,
					"extra_args": map[string]any{"kv_transfer_params": handoffParams}}},
			map[string]any{"request_id": id, "token_ids": []any{1.0, 2.0, 3.0}, "features": nil,
				"stream": false, "stream_options": nil, "kv_transfer_params": kv,
				"sampling_params": map[string]any{"max_tokens": 8.0, "n": 1.0,
					"extra_args": map[string]any{"kv_transfer_params": kv}}},
		},
		"/v1/chat/completions/derender": {map[string]any{"stream": false, "model": "qwen",
			"generate_response": parsed(t, []byte(`{"request_id":"d","choices":[{"index":0,"token_ids":[7,8],"finish_reason":"stop","stop_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}`)),
			"prompt_tokens":     3.0, "prompt_token_ids": []any{1.0, 2.0, 3.0},
			"chat_request": parsed(t, []byte(client))}},
	}
	for path, bodies := range want {
		if !reflect.DeepEqual(s.sent[path], bodies) {
			t.Fatalf("%s was sent\n%v\nwant\n%v", path, s.sent[path], bodies)
		}
	}
	if p.stats.renderPD.Load() != 1 {
		t.Fatalf("render_pd %d", p.stats.renderPD.Load())
	}
	for _, h := range p.metrics.snapshot()["stages"].([]histogramJSON) {
		if observed([]histogramJSON{h}) != 1 { // render, prefill and derender, once each
			t.Fatalf("stage %v observed %d times", h.Labels, observed([]histogramJSON{h}))
		}
	}
	if n := len(p.metrics.stage.snapshot()); n != 3 {
		t.Fatalf("%d stages measured, want render, prefill and derender", n)
	}
	// A stream asking for log probabilities is refused here, as the Python gateway refuses it.
	streamed := `{"model":"qwen","messages":[{"role":"user","content":"hi"}],"stream":true,"logprobs":true}`
	refused := httptest.NewRecorder()
	if reason := p.fast(context.Background(), refused, httptest.NewRequest("POST", "/v1/chat/completions", nil),
		tbl, []byte(streamed), &served{metrics: p.metrics}); reason != "" || refused.Code != 400 ||
		!strings.Contains(refused.Body.String(), `"param":"logprobs"`) {
		t.Fatalf("stream with logprobs: %q %d %s", reason, refused.Code, refused.Body.String())
	}
}

func TestARenderedStreamIsDerenderedChunkByChunkWithItsStateCarried(t *testing.T) {
	s, p, _ := renderPlane(t, `{"version":1,"derenderPipelining":false,"models":{"qwen":{"route":"decode",
		"render":["URL"],"groups":[{"prefill":[],"decode":["URL"]}]}}}`)
	client := `{"model":"qwen","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`
	recorder := httptest.NewRecorder()
	p.serveCompletion(recorder, httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(client)))
	id := recorder.Header().Get("X-PDServe-Request-Id")
	if recorder.Code != 200 || recorder.Header().Get("Content-Type") != "text/event-stream" || id == "" {
		t.Fatalf("%d %v %s", recorder.Code, recorder.Header(), recorder.Body.String())
	}
	events := strings.Split(strings.TrimSuffix(recorder.Body.String(), "\n\n"), "\n\n")
	if len(events) != 4 || events[3] != "data: [DONE]" {
		t.Fatalf("events %q", events)
	}
	// The stop token (0) is not derendered; each chunk is named as the gateway's.
	sameJSON(t, []byte(strings.TrimPrefix(events[0], "data: ")), `{"id":"`+id+`","object":"chat.completion.chunk","model":"qwen","choices":[{"index":0,"delta":{"content":"t"},"finish_reason":null}]}`)
	sameJSON(t, []byte(strings.TrimPrefix(events[1], "data: ")), `{"id":"`+id+`","object":"chat.completion.chunk","model":"qwen","choices":[{"index":0,"delta":{"content":"t"},"finish_reason":"stop"}]}`)
	usage := parsed(t, []byte(strings.TrimPrefix(events[2], "data: "))).(map[string]any)
	if usage["id"] != id || fmt.Sprint(usage["choices"]) != "[]" || usage["usage"].(map[string]any)["completion_tokens"] != 3.0 {
		t.Fatalf("usage event %v", usage)
	}
	calls := s.sent["/v1/chat/completions/derender"]
	if len(calls) != 2 {
		t.Fatalf("derender calls %v", calls)
	}
	second := calls[1].(map[string]any)
	if fmt.Sprint(second["stream_state"]) != "map[seen:1]" || second["prompt_tokens"] != 3.0 ||
		fmt.Sprint(second["generate_chunk"]) != "map[choices:[map[finish_reason:stop index:0 logprobs:<nil> token_ids:[8]]] request_id:"+id+"]" {
		t.Fatalf("second derender call %v", second)
	}
	if p.stats.renderDecode.Load() != 1 || p.stats.streams.Load() != 1 {
		t.Fatalf("counted %d %d", p.stats.renderDecode.Load(), p.stats.streams.Load())
	}
	// Measured as the Python gateway measures what it serves: one request, its first token and
	// the gap to the second chunk, one render and two derender calls to the render server.
	measured := p.metrics.snapshot()
	if got := fmt.Sprint(measured["requests"]); got != "[{render_decode ok 1}]" {
		t.Fatalf("requests %s", got)
	}
	for name, want := range map[string]int64{"e2e": 1, "ttft": 1, "itl": 1} {
		if got := observed(measured[name].([]histogramJSON)); got != want {
			t.Fatalf("%s: %d observations, want %d", name, got, want)
		}
	}
	byStage := map[string]int64{}
	for _, h := range measured["renderCalls"].([]histogramJSON) {
		byStage[h.Labels[1]] += observed([]histogramJSON{h})
	}
	if byStage["render"] != 1 || byStage["derender"] != 2 {
		t.Fatalf("render calls %v", byStage)
	}
	// One choice of two derender calls, one token each (the stop token dropped), unlabelled.
	for name, want := range map[string]string{"derenderCalls": "[{[] [0 1 0 0] 2}]",
		"derenderTokens": "[{[] [2 0 0 0] 2}]"} {
		if got := fmt.Sprint(measured[name]); got != want {
			t.Fatalf("%s %s, want %s", name, got, want)
		}
	}
	stages := map[string]int64{}
	for _, h := range measured["stages"].([]histogramJSON) {
		stages[h.Labels[0]] += observed([]histogramJSON{h})
	}
	if len(stages) != 3 || stages["render"] != 1 || stages["derender"] != 2 || // no prefill: decode route
		stages["decode_first_token"] != 1 {
		t.Fatalf("stages %v", stages)
	}
}

func observed(hs []histogramJSON) int64 {
	var n int64
	for _, h := range hs {
		for _, c := range h.Counts {
			n += c
		}
	}
	return n
}

// statsOf: the data plane's GET /stats, decoded.
func statsOf(t *testing.T, p *plane) map[string]any {
	t.Helper()
	recorder := httptest.NewRecorder()
	p.getStats(recorder, httptest.NewRequest("GET", "/stats", nil))
	var out map[string]any
	if err := json.Unmarshal(recorder.Body.Bytes(), &out); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestStatsSayWhichRenderServersHaveCallsInFlightAndEachDecodesStepTime(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	engines := &renderStack{sent: map[string][]any{}}
	slowRender := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-release // the render call stays in flight until the test has read the stats
		engines.handler(t).ServeHTTP(w, r)
	}))
	t.Cleanup(slowRender.Close)
	_, p, _ := renderPlane(t, `{"version":1,"models":{"qwen":{"route":"pd","render":["`+slowRender.URL+`"],
		"groups":[{"prefill":["URL"],"decode":["URL"]}]}}}`)
	done := make(chan int)
	go func() {
		recorder := httptest.NewRecorder()
		p.serveCompletion(recorder, httptest.NewRequest("POST", "/v1/chat/completions",
			strings.NewReader(`{"model":"qwen","messages":[{"role":"user","content":"hi"}]}`)))
		done <- recorder.Code
	}()
	<-entered
	inflight := statsOf(t, p)["engineInflight"].(map[string]any)
	if len(inflight) != 1 || inflight[slowRender.URL] != 1.0 {
		t.Fatalf("engineInflight during the render call: %v, want %s: 1", inflight, slowRender.URL)
	}
	close(release)
	if code := <-done; code != 200 {
		t.Fatalf("answered %d", code)
	}
	stats := statsOf(t, p)
	if inflight := stats["engineInflight"].(map[string]any); len(inflight) != 0 {
		t.Fatalf("engineInflight after the request: %v", inflight)
	}
	if steps := stats["stepSeconds"].(map[string]any); len(steps) != 0 {
		t.Fatalf("stepSeconds before any stream was measured: %v", steps)
	}
	var decode *endpoint
	for _, e := range p.engines {
		if e.url != slowRender.URL {
			decode = e
		}
	}
	now := time.Now()
	decode.steps.observe(20*time.Millisecond, now, time.Millisecond)
	decode.steps.observe(20*time.Millisecond, now.Add(time.Millisecond), time.Millisecond)
	if steps := statsOf(t, p)["stepSeconds"].(map[string]any); steps[decode.key] != 0.02 {
		t.Fatalf("stepSeconds %v, want %s: 0.02", steps, decode.key)
	}
}
