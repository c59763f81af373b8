package main

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"
)

func pushTable(t *testing.T, p *plane, table string) {
	t.Helper()
	recorder := httptest.NewRecorder()
	p.putTable(recorder, httptest.NewRequest("PUT", "/table", strings.NewReader(table)))
	if recorder.Code != http.StatusNoContent {
		t.Fatalf("table refused: %d %s", recorder.Code, recorder.Body)
	}
}

// No prefill replica may take P/D (its transport not Verified, no KV-compatible decode): every
// request prefills on decode, counted under the Python gateway's fallback reason.
func TestEveryRequestOfALocalPrefillTableIsCountedUnderItsReason(t *testing.T) {
	table := `{"version":1,"models":{"m":{"route":"decode","localPrefillReason":"transport_unverified",` +
		`"groups":[{"prefill":[],"decode":["URL"]}]}}}`
	u := newPlaneUnderTest(t, table, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","choices":[{"index":0,"finish_reason":"stop"}]}`)
	}, nil)
	for range 2 {
		if response, body := u.post(t, chatBody); response.StatusCode != 200 {
			t.Fatalf("%d %s", response.StatusCode, body)
		}
	}
	if got := snapshot(&u.p.stats.localPrefills)["transport_unverified"]; got != 2 {
		t.Fatalf("counted %d, want 2", got)
	}
}

// A request that arrives before the first routing table waits for it (the Python gateway pushes
// it a moment after the data plane listens) and is then served, its key checked as any
// request's; none is handed over.
func TestARequestBeforeTheFirstTableWaitsForItAndItsKeyIsChecked(t *testing.T) {
	u := newPlaneUnderTest(t, decodeTable, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","choices":[{"index":0,"finish_reason":"stop"}]}`)
	}, nil)
	table := u.p.current.Load()
	engine := table.models["m"].decodes[0].at.host
	u.p.current.Store(nil) // as the data plane starts: no table yet
	answered := make(chan int, 2)
	for _, key := range []string{"", "wrong"} {
		go func() {
			request, _ := http.NewRequest("POST", u.url+"/v1/chat/completions", strings.NewReader(chatBody))
			if key != "" {
				request.Header.Set("Authorization", "Bearer "+key)
			}
			response, err := http.DefaultClient.Do(request)
			if err != nil {
				answered <- 0
				return
			}
			response.Body.Close()
			answered <- response.StatusCode
		}()
	}
	for deadline := time.Now().Add(10 * time.Second); u.p.inflight.Load() < 2; runtime.Gosched() {
		if time.Now().After(deadline) {
			t.Fatal("the requests never waited for a table")
		}
	}
	keyed := `{"version":2,"apiKeySha256":["` + sha256Hex("wrong-not") + `"],"models":{"m":{"route":"decode",` +
		`"groups":[{"prefill":[],"decode":["http://` + engine + `"]}]}}}`
	pushTable(t, u.p, keyed)
	got := []int{<-answered, <-answered}
	if got[0] != 401 || got[1] != 401 {
		t.Fatalf("answered %v, want 401 for both: the first table's keys apply", got)
	}
	if seen := u.python.seen(); len(seen) != 0 {
		t.Fatalf("handed to the Python gateway: %v", seen)
	}
	open := `{"version":3,"models":{"m":{"route":"decode","groups":[{"prefill":[],"decode":["http://` + engine + `"]}]}}}`
	pushTable(t, u.p, open)
	if response, body := u.post(t, chatBody); response.StatusCode != 200 {
		t.Fatalf("%d %s", response.StatusCode, body)
	}
}

func sha256Hex(key string) string {
	digest := sha256.Sum256([]byte(key))
	return hex.EncodeToString(digest[:])
}
