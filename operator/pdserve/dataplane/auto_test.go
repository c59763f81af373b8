package main

import (
	"slices"
	"strings"
	"testing"
	"time"
)

// autoCase is one of testdata/auto_decision_cases.json, which the Python gateway's tests read
// too (tests/unit/gateway/test_auto_cases.py).
type autoCase struct {
	Name             string       `json:"name"`
	View             autoView     `json:"view"`
	Probe            bool         `json:"probe"`
	PromptTokens     *int64       `json:"promptTokens"`
	PrefillAvailable bool         `json:"prefillAvailable"`
	PrefillReplicas  []string     `json:"prefillReplicas"`
	Queues           queueState   `json:"queues"`
	Want             autoDecision `json:"want"`
}

func TestAutoDecidesEachSharedCaseAsThePythonGatewayDoes(t *testing.T) {
	cases := sharedCases[[]autoCase](t, "auto_decision_cases.json")
	if len(cases) < 20 {
		t.Fatalf("%d cases: the file lost some", len(cases))
	}
	for _, c := range cases {
		asked := 0
		probe := func() bool { asked++; return c.Probe }
		got := decideAuto(&c.View, c.PromptTokens, c.PrefillAvailable, &c.Queues, c.PrefillReplicas, probe)
		want := c.Want
		if got.Disaggregated != want.Disaggregated || got.Reason != want.Reason ||
			got.Anywhere != want.Anywhere || !slices.Equal(nonNil(got.Prefill), nonNil(want.Prefill)) {
			t.Errorf("%s: got %+v, want %+v", c.Name, got, want)
		}
		if wantAsked := map[bool]int{true: 1}[want.Reason == "probe" || want.Reason == "degraded"]; asked != wantAsked {
			t.Errorf("%s: probe asked %d times, want %d", c.Name, asked, wantAsked)
		}
	}
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

const autoTable = `{"version":1,"models":{"qwen":{"route":"auto","groups":[
	{"prefill":["http://p0:8000"],"decode":["http://d0:8000"]}],
	"auto":{"view":{"shortPromptTokens":512,"localWhenDecodeIdle":true,"pdTtftShare":0.9,
	"itlShare":0.9,"ttftBudget":1.0,"itlBudget":null,"degraded":false,"learning":false,
	"secondsPerToken":null,"byPrefill":{},"prefillSecondsPerToken":null,"outputTokens":null},
	"probeEvery":3,"learningTimeoutSeconds":60,"localOnPrefillPool":true,
	"queues":{"http://d0:8000":{"waiting":1,"running":1,"backlog":0}},"queued":0}}}}`

func TestOneRequestAtATimeMeasuresTheFirstHandoff(t *testing.T) {
	built, _ := mustBuild(t, autoTable, nil)
	m, a := built.models["qwen"], &autoRuntime{}
	if d := a.decide(m.auto, m, 2000, 0); !d.Disaggregated || d.Reason != "long_prompt" {
		t.Fatalf("the first long prompt: %+v, want P/D to measure the handoff", d)
	}
	if d := a.decide(m.auto, m, 2000, 0); d.Disaggregated || d.Reason != "handoff_unknown" || !d.Anywhere {
		t.Fatalf("the second, while the first measures: %+v, want local anywhere", d)
	}
	if a.learningStarts.Load() != 1 {
		t.Fatalf("learning starts reported: %d, want 1", a.learningStarts.Load())
	}
	a.learningSince.Store(time.Now().Add(-2 * time.Minute).UnixNano()) // the measurement timed out
	if d := a.decide(m.auto, m, 2000, 0); !d.Disaggregated {
		t.Fatalf("after the measurement's timeout: %+v, want the next one to try", d)
	}
}

func TestWhileDegradedEveryNthEligibleRequestProbes(t *testing.T) {
	built, _ := mustBuild(t, strings.Replace(autoTable, `"degraded":false`, `"degraded":true`, 1), nil)
	m, a := built.models["qwen"], &autoRuntime{}
	var reasons []string
	for range 6 {
		reasons = append(reasons, a.decide(m.auto, m, 2000, 0).Reason)
	}
	a.decide(m.auto, m, 10, 0) // short: not eligible, not counted
	want := []string{"degraded", "degraded", "probe", "degraded", "degraded", "probe"}
	if !slices.Equal(reasons, want) {
		t.Fatalf("decisions %v, want %v", reasons, want)
	}
	if got := a.snapshot(0)["decisions"].(map[string]int64); got["probe"] != 2 || got["degraded"] != 4 || got["short_prompt"] != 1 {
		t.Fatalf("decisions reported %v", got)
	}
}

func TestAnIdleDecodeIsSeenThroughTheDataPlanesOwnInFlight(t *testing.T) {
	idle := strings.Replace(autoTable, `"waiting":1,"running":1`, `"waiting":0,"running":0`, 1)
	built, engines := mustBuild(t, idle, nil)
	m, a := built.models["qwen"], &autoRuntime{}
	if d := a.decide(m.auto, m, 2000, 0); d.Reason != "decode_idle" {
		t.Fatalf("idle decode: %+v", d)
	}
	engines["http://d0:8000"].inflight.Add(1) // sent since the last scrape
	if d := a.decide(m.auto, m, 2000, 0); d.Reason == "decode_idle" {
		t.Fatalf("decode with a request in flight here decided %+v", d)
	}
}

func TestLocalAnywhereMayRunWholeOnAnIdlerPrefillReplica(t *testing.T) {
	built, engines := mustBuild(t, autoTable, nil)
	m := built.models["qwen"]
	engines["http://d0:8000"].inflight.Add(3)
	if _, decode := m.pickAuto(autoDecision{Reason: "degraded", Anywhere: true}, true, nil); decode.url != "http://p0:8000" {
		t.Fatalf("local anywhere went to %s, want the idler prefill replica", decode.url)
	}
	if _, decode := m.pickAuto(autoDecision{Reason: "degraded", Anywhere: true}, false, nil); decode.url != "http://d0:8000" {
		t.Fatalf("with localOnPrefillPool off it went to %s", decode.url)
	}
	if _, decode := m.pickAuto(autoDecision{Reason: "short_prompt"}, true, nil); decode.url != "http://d0:8000" {
		t.Fatalf("a short prompt went to %s, want decode", decode.url)
	}
	if prefill, _ := m.pickAuto(autoDecision{Disaggregated: true, Prefill: []string{"http://elsewhere"}}, true, nil); prefill != nil {
		t.Fatalf("P/D restricted to a replica not in the table picked %s", prefill.url)
	}
}

func TestObservationsWaitInABoundedRingForThePythonGateway(t *testing.T) {
	a := &autoRuntime{}
	for i := range observationRing + 5 {
		a.observe("output", 0, int64(i), "")
	}
	held := a.snapshot(0)["observations"].([]observation)
	if len(held) != observationRing || held[0].Seq != 6 || held[len(held)-1].Seq != observationRing+5 {
		t.Fatalf("held %d, from seq %d to %d", len(held), held[0].Seq, held[len(held)-1].Seq)
	}
	newer := a.snapshot(observationRing)["observations"].([]observation) // folded up to there
	if len(newer) != 5 || newer[0].Seq != observationRing+1 {
		t.Fatalf("after %d: %d held, from seq %d", observationRing, len(newer), newer[0].Seq)
	}
	if none := a.snapshot(observationRing + 5)["observations"].([]observation); len(none) != 0 {
		t.Fatalf("after the last: %d held", len(none))
	}
}

func TestARouteAutoNeedsItsAutoBlock(t *testing.T) {
	raw := `{"models":{"qwen":{"route":"auto","groups":[{"decode":["http://d"]}]}}}`
	if _, _, err := build([]byte(raw), nil); err == nil || !strings.Contains(err.Error(), "models.qwen") {
		t.Fatalf("build: %v", err)
	}
}

func TestAPromptIsEstimatedAtFourBytesOfItsJSONAToken(t *testing.T) {
	for body, want := range map[string]int64{
		`{"messages":[{"role":"user","content":"0123456789"}]}`:       10,
		`{"messages":[],"prompt":"` + strings.Repeat("a", 398) + `"}`: 100,
		`{"prompt":null}`: 0,
	} {
		members, err := topLevel([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		if got := estimatedPromptTokens(members); got != want {
			t.Errorf("%s: %d tokens, want %d", body, got, want)
		}
	}
}

func TestAutosRestrictionHoldsForAdmissionAndRetries(t *testing.T) {
	built, _ := mustBuild(t, twoGroups, nil)
	m := built.models["qwen"]
	p0 := m.groups[0].prefill[0]
	only := []string{"http://p0:8000"}
	if ranked := m.rankedPrefill(p0, only, nil); len(ranked) != 1 {
		t.Fatalf("ranked %d prefill replicas, want p0 alone", len(ranked))
	}
	if others := m.otherPrefills(p0, only, nil); len(others) != 0 {
		t.Fatalf("a retry would go to %s, outside Auto's restriction", others[0].url)
	}
	if others := m.otherPrefills(p0, nil, nil); len(others) != 1 || others[0].url != "http://p1:8000" {
		t.Fatalf("unrestricted retries %v, want p1", others)
	}
}

func TestTheStepMeterSmoothsWindowMeansAndStartsAnewAfterAQuietSpell(t *testing.T) {
	var m stepMeter
	start, window := time.Unix(1000, 0), time.Second
	m.observe(20*time.Millisecond, start, window)
	if _, known := m.read(); known {
		t.Fatal("a step time before any window closed")
	}
	m.observe(40*time.Millisecond, start.Add(window), window) // the window closes: mean 30 ms
	if got, _ := m.read(); got < 0.0299 || got > 0.0301 {
		t.Fatalf("first window %g s, want 0.030", got)
	}
	m.observe(10*time.Millisecond, start.Add(5*window), window) // after a quiet spell: anew
	m.observe(10*time.Millisecond, start.Add(6*window), window) // mean 10 ms, smoothed by half
	if got, _ := m.read(); got < 0.0199 || got > 0.0201 {
		t.Fatalf("smoothed %g s, want 0.020", got)
	}
}

func TestAutoReadsTheStepTimeOfTheStreamsItRelaysOverTheScrapedOne(t *testing.T) {
	raw := strings.Replace(autoTable, `"backlog":0}`, `"backlog":0,"stepSeconds":0.5}`, 1)
	built, engines := mustBuild(t, raw, nil)
	m := built.models["qwen"]
	q, _ := m.auto.queues(m, 0)
	if q.DecodeStepSeconds == nil || *q.DecodeStepSeconds != 0.5 {
		t.Fatalf("step time %v, want the pushed 0.5", q.DecodeStepSeconds)
	}
	decode, now := engines["http://d0:8000"], time.Now()
	decode.steps.observe(20*time.Millisecond, now, time.Millisecond)
	decode.steps.observe(20*time.Millisecond, now.Add(time.Millisecond), time.Millisecond)
	if q, _ = m.auto.queues(m, 0); *q.DecodeStepSeconds > 0.021 {
		t.Fatalf("step time %g, want its own 0.020", *q.DecodeStepSeconds)
	}
}

// The prompts this data plane sent prefill and that are not prefilled yet count as queued
// there (planner.queue_state reads the Python gateway's own the same way): past the TTFT
// target, the next long prompt prefills on decode instead.
func TestThePromptTokensOwedHereCountInPrefillsQueue(t *testing.T) {
	measured := strings.NewReplacer(`"learning":false`, `"learning":null`,
		`"secondsPerToken":null`, `"secondsPerToken":0.00001`,
		`"prefillSecondsPerToken":null`, `"prefillSecondsPerToken":0.0001`).Replace(autoTable)
	built, engines := mustBuild(t, measured, nil)
	m, a := built.models["qwen"], &autoRuntime{}
	if d := a.decide(m.auto, m, 2000, 0); d.Reason != "long_prompt" {
		t.Fatalf("an idle prefill pool: %+v, want P/D", d)
	}
	// 8,000 tokens ahead at 0.1 ms each: 0.8 s of wait, past 0.9 x the 1 s budget with this prompt.
	prefilled := engines["http://p0:8000"].owe(8000)
	if d := a.decide(m.auto, m, 2000, 0); d.Disaggregated || d.Reason != "prefill_queue_over_ttft_budget" {
		t.Fatalf("8,000 tokens owed on prefill: %+v, want local prefill", d)
	}
	prefilled()
	if d := a.decide(m.auto, m, 2000, 0); d.Reason != "long_prompt" {
		t.Fatalf("once prefilled: %+v, want P/D again", d)
	}
}
