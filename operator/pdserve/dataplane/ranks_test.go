package main

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// rankLog: what one engine server was sent, per hop: the X-data-parallel-rank of each call.
type rankLog struct {
	mu      sync.Mutex
	prefill []string
	decode  []string
}

func (l *rankLog) seen() (prefill, decode []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.prefill...), append([]string(nil), l.decode...)
}

// rankedEngine answers prefill (max_tokens 1) and decode calls, noting each call's rank header;
// with fail set, the hop it names ("prefill" or "decode") answers 500 as a broken server
// would on every rank.
func rankedEngine(log *rankLog, fail string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		_ = json.NewDecoder(r.Body).Decode(&body)
		rank := r.Header.Get("X-data-parallel-rank")
		log.mu.Lock()
		prefill := body["max_tokens"] == 1.0
		if prefill {
			log.prefill = append(log.prefill, rank)
		} else {
			log.decode = append(log.decode, rank)
		}
		log.mu.Unlock()
		if (prefill && fail == "prefill") || (!prefill && fail == "decode") {
			w.WriteHeader(http.StatusInternalServerError)
			io.WriteString(w, `{"error":{"message":"engine core died"}}`)
			return
		}
		if prefill {
			io.WriteString(w, `{"choices":[{"index":0,"text":"","finish_reason":"length"}],`+
				`"kv_transfer_params":{"remote_engine_id":"e","remote_port":5600}}`)
			return
		}
		io.WriteString(w, `{"choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}]}`)
	}
}

// A pod serving two data-parallel ranks is two routing targets, `<url>#dp<n>`: each hop goes to
// the rank the table's load (the Python gateway's scrape per rank) and this data plane's own
// requests in flight make least busy, pinned with vLLM's header; a client's own header is
// never passed on.
func TestEachHopIsPinnedToTheLeastBusyRankOfItsPod(t *testing.T) {
	for _, c := range []struct {
		load string
		want string
	}{
		{`{"URL#dp0":4,"URL#dp1":0}`, "1"},
		{`{"URL#dp0":0,"URL#dp1":4}`, "0"},
	} {
		log := &rankLog{}
		table := `{"version":1,"models":{"m":{"route":"pd","groups":[
			{"prefill":["URL#dp0","URL#dp1"],"decode":["URL#dp0","URL#dp1"]}]}},"load":` + c.load + `}`
		u := newPlaneUnderTest(t, table, rankedEngine(log, ""), nil)
		response, text := u.post(t, chatBody, "X-data-parallel-rank", "7")
		if response.StatusCode != 200 || !strings.Contains(text, "hi") {
			t.Fatalf("%d %s", response.StatusCode, text)
		}
		prefill, decode := log.seen()
		if len(prefill) != 1 || prefill[0] != c.want || len(decode) != 1 || decode[0] != c.want {
			t.Fatalf("load %s: prefill ranks %q, decode ranks %q, want %q on both", c.load, prefill, decode, c.want)
		}
		if len(u.python.seen()) != 0 {
			t.Fatal("handed over")
		}
	}
}

// retriedElsewhere serves one chat request by `table` (URL: a server of two ranks that fails
// the `failing` hop on both; OTHER: a healthy server) and says what each server was sent.
func retriedElsewhere(t *testing.T, table, failing string) (broken, healthy *rankLog, u *planeUnderTest) {
	t.Helper()
	broken, healthy = &rankLog{}, &rankLog{}
	other := httptest.NewServer(rankedEngine(healthy, ""))
	t.Cleanup(other.Close)
	u = newPlaneUnderTest(t, strings.ReplaceAll(table, "OTHER", other.URL), rankedEngine(broken, failing), nil)
	response, text := u.post(t, chatBody)
	if response.StatusCode != 200 || !strings.Contains(text, "hi") {
		t.Fatalf("%d %s", response.StatusCode, text)
	}
	return broken, healthy, u
}

// A prefill server that fails a request fails it on every rank (one process fronts them all):
// the retry goes to another server, never to the failed one's other rank; an engine without
// ranks gets no header.
func TestAFailedPrefillIsRetriedOnAnotherServerNotOnItsOtherRank(t *testing.T) {
	broken, healthy, u := retriedElsewhere(t, `{"version":1,"models":{"m":{"route":"pd","groups":[
		{"prefill":["URL#dp0","URL#dp1","OTHER"],"decode":["OTHER"]}]}},"load":{"OTHER":3}}`, "prefill")
	failed, _ := broken.seen()
	retried, decoded := healthy.seen()
	if len(failed) != 1 || len(retried) != 1 || retried[0] != "" || len(decoded) != 1 {
		t.Fatalf("broken server's prefills %q, the other's %q and decodes %q: want one each, no rank on the other",
			failed, retried, decoded)
	}
	if got := snapshot(&u.p.stats.localPrefills); len(got) != 0 {
		t.Fatalf("local prefills %v: the other server's prefill should have served", got)
	}
	if got := snapshot(&u.p.stats.retries); len(got) != 1 || got["prefill/upstream_error"] != 1 {
		t.Fatalf("retries %v, want the Python gateway's one prefill/upstream_error", got)
	}
}

// The same for decode: a decode server that failed is not asked again on another rank.
func TestAFailedDecodeIsRetriedOnAnotherServerNotOnItsOtherRank(t *testing.T) {
	broken, healthy, u := retriedElsewhere(t, `{"version":1,"models":{"m":{"route":"decode","groups":[
		{"prefill":[],"decode":["URL#dp0","URL#dp1","OTHER"]}]}},"load":{"OTHER":3}}`, "decode")
	_, failed := broken.seen()
	_, retried := healthy.seen()
	if len(failed) != 1 || len(retried) != 1 {
		t.Fatalf("broken server's decodes %q, the other's %q: want one each", failed, retried)
	}
	if got := snapshot(&u.p.stats.retries); len(got) != 1 || got["decode/upstream_error"] != 1 {
		t.Fatalf("retries %v, want the Python gateway's one decode/upstream_error", got)
	}
}

func TestARankIsNamedOnlyAsDpAndANumber(t *testing.T) {
	for _, raw := range []string{"http://p:8000#rank1", "http://p:8000#dp", "http://p:8000#dp-1", "http://p:8000#dp01"} {
		table := `{"models":{"m":{"route":"decode","groups":[{"decode":["` + raw + `"]}]}}}`
		if _, _, err := build([]byte(table), nil); err == nil || !strings.Contains(err.Error(), raw) {
			t.Fatalf("%s: %v, want a refusal naming it", raw, err)
		}
	}
	built, engines := mustBuild(t, `{"models":{"m":{"route":"decode","groups":[{"decode":["http://p:8000#dp3"]}]}},
		"load":{"http://p:8000#dp3":2}}`, nil)
	e := engines["http://p:8000#dp3"]
	if e == nil || e.url != "http://p:8000" || e.at.rank != "3" || e.load() != 2 || built.models["m"].groups[0].decode[0] != e {
		t.Fatalf("endpoint %+v", e)
	}
}
