package main

import (
	"crypto/sha256"
	"fmt"
	"strings"
	"testing"
)

func mustBuild(t *testing.T, raw string, known map[string]*endpoint) (*table, map[string]*endpoint) {
	t.Helper()
	built, engines, err := build([]byte(raw), known)
	if err != nil {
		t.Fatalf("build: %v", err)
	}
	return built, engines
}

const twoGroups = `{"version":1,"models":{"qwen":{"route":"pd","groups":[
	{"prefill":["http://p0:8000"],"decode":["http://d0:8000"]},
	{"prefill":["http://p1:8000"],"decode":["http://d1:8000","http://d2:8000"]}]}},
	"load":{"http://p0:8000":3}}`

func TestPickPairsAPrefillOnlyWithADecodeOfItsGroup(t *testing.T) {
	built, engines := mustBuild(t, twoGroups, nil)
	m := built.models["qwen"]
	prefill, decode := m.pick(nil)
	// p0 carries the Python gateway's scraped load of 3: p1 is less loaded.
	if prefill.url != "http://p1:8000" || !strings.HasPrefix(decode.url, "http://d1") {
		t.Fatalf("picked %s -> %s, want p1 -> d1", prefill.url, decode.url)
	}
	engines["http://d1:8000"].inflight.Add(1)
	if _, decode = m.pick(nil); decode.url != "http://d2:8000" {
		t.Fatalf("picked decode %s with d1 busy, want d2", decode.url)
	}
	engines["http://p1:8000"].inflight.Add(5)
	if prefill, decode = m.pick(nil); prefill.url != "http://p0:8000" || decode.url != "http://d0:8000" {
		t.Fatalf("picked %s -> %s with p1 busier, want p0 -> d0", prefill.url, decode.url)
	}
}

func TestAnEngineKeepsItsInFlightCountAcrossTables(t *testing.T) {
	_, engines := mustBuild(t, twoGroups, nil)
	engines["http://d0:8000"].inflight.Add(2)
	_, next := mustBuild(t, strings.Replace(twoGroups, `"version":1`, `"version":2`, 1), engines)
	if got := next["http://d0:8000"].inflight.Load(); got != 2 {
		t.Fatalf("in flight after the update: %d, want 2", got)
	}
}

func TestBuildNamesTheFieldItRefuses(t *testing.T) {
	for raw, field := range map[string]string{
		`{"models":{"qwen":{"route":"fast"}}}`:                                     "models.qwen.route",
		`{"models":{"qwen":{"route":"pd","groups":[{"decode":["http://d"]}]}}}`:    "models.qwen.groups[0]",
		`{"models":{"qwen":{"route":"decode"}}}`:                                   "models.qwen",
		`{"models":{"qwen":{"route":"decode","groups":[{"decode":["ftp://d"]}]}}}`: "ftp://d",
		`{"apiKeySha256":["zz"]}`:                                                  "apiKeySha256",
		`{"models":[]}`:                                                            "routing table",
	} {
		if _, _, err := build([]byte(raw), nil); err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: error %v, want one naming %s", raw, err, field)
		}
	}
}

func TestAuthorizedComparesBearerTokensWithTheKeysDigests(t *testing.T) {
	digest := sha256.Sum256([]byte("secret"))
	built, _ := mustBuild(t, fmt.Sprintf(`{"apiKeySha256":["%x"]}`, digest), nil)
	for header, want := range map[string]bool{
		"Bearer secret": true, "bearer  secret ": true, "Bearer other": false, "secret": false,
		"": false, "Basic secret": false,
	} {
		if got := built.authorized(header); got != want {
			t.Errorf("Authorization %q: %v, want %v", header, got, want)
		}
	}
	open, _ := mustBuild(t, `{}`, nil)
	if !open.authorized("") {
		t.Error("without keys every request is authorized")
	}
}

func TestTheCapRefusesWhatThePythonGatewayWouldRefuseOrFillsItIn(t *testing.T) {
	type verdict struct {
		over       string
		fill, read bool
	}
	for body, want := range map[string]verdict{
		`{"max_tokens":8}`: {"", false, true}, `{"max_completion_tokens":8}`: {"", false, true},
		`{"max_tokens":9}`: {"max_tokens", false, true}, `{"max_completion_tokens":9}`: {"max_completion_tokens", false, true},
		`{"max_tokens":9,"max_completion_tokens":10}`: {"max_tokens", false, true},
		`{}`: {"", true, true}, `{"max_tokens":null}`: {"", true, true}, `{"max_tokens":"8"}`: {"", false, false},
	} {
		members, err := topLevel([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		if over, fill, read := capLimits(members, 8, true); (verdict{over, fill, read}) != want {
			t.Errorf("chat %s: %v, want %v", body, verdict{over, fill, read}, want)
		}
	}
	// Completions: max_completion_tokens is not theirs (vLLM ignores it): the cap is filled in.
	for body, want := range map[string]verdict{
		`{"max_tokens":8}`: {"", false, true}, `{"max_completion_tokens":9}`: {"", true, true},
		`{"max_tokens":8,"max_completion_tokens":[null]}`: {"", false, true},
	} {
		members, err := topLevel([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		if over, fill, read := capLimits(members, 8, false); (verdict{over, fill, read}) != want {
			t.Errorf("completion %s: %v, want %v", body, verdict{over, fill, read}, want)
		}
	}
}

func TestATokensOnlyEnginesTableKeepsItsRenderServers(t *testing.T) {
	built, _ := mustBuild(t, `{"version":1,"tokensOnlyEngines":true,
		"models":{"qwen":{"route":"decode","render":["http://r0:8000"],"groups":[{"prefill":[],"decode":["http://d0:8000"]}]},
		"off":{"route":"unavailable","render":["http://r1:8000"],"groups":[]}}}`, nil)
	if got := built.models["qwen"].render; len(got) != 1 || got[0].url != "http://r0:8000" {
		t.Fatalf("render %v", got)
	}
	if built.models["off"].render != nil {
		t.Fatal("an unavailable route keeps no render servers")
	}
	if !built.tokensOnly {
		t.Fatal("tokensOnlyEngines not read")
	}
}

func TestAnEngineListedInTwoGroupsIsOneEngine(t *testing.T) {
	raw := `{"models":{"qwen":{"route":"pd","groups":[
		{"prefill":["http://p0:8000"],"decode":["http://d:8000"]},
		{"prefill":["http://p1:8000"],"decode":["http://d:8000"]}]}}}`
	built, _ := mustBuild(t, raw, nil)
	groups := built.models["qwen"].groups
	if groups[0].decode[0] != groups[1].decode[0] {
		t.Fatal("the decode engine of both groups is two engines: their in-flight counts part")
	}
}
