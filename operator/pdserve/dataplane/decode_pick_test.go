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

// Decode is picked once prefill answered, by the loads then, as the Python gateway picks it:
// request b, routed while a's decode had not started, still decodes on the other engine once
// a's decode holds the first. Picked on arrival, both would have gone to the first.
func TestDecodeIsPickedAfterPrefillByTheLoadsThen(t *testing.T) {
	release := map[string]chan struct{}{"a": make(chan struct{}), "b": make(chan struct{})}
	arrived := make(chan string, 2)
	aDecoding, aFinish := make(chan struct{}), make(chan struct{})
	var mu sync.Mutex
	var decodedOn []string
	content := func(r *http.Request) string {
		var body struct {
			Messages []struct{ Content string } `json:"messages"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		return body.Messages[0].Content
	}
	decodeEngine := func(name string) *httptest.Server {
		server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			text := content(r)
			if name == "first" && text == "a" { // a's decode holds this engine until the end
				close(aDecoding)
				<-aFinish
			}
			mu.Lock()
			decodedOn = append(decodedOn, name+":"+text)
			mu.Unlock()
			io.WriteString(w, `{"choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}]}`)
		}))
		t.Cleanup(server.Close)
		return server
	}
	first, other := decodeEngine("first"), decodeEngine("other")
	table := `{"version":1,"models":{"m":{"route":"pd","groups":[{"prefill":["URL"],"decode":["` +
		first.URL + `","` + other.URL + `"]}]}}}`
	u := newPlaneUnderTest(t, table, func(w http.ResponseWriter, r *http.Request) {
		text := content(r) // prefill, answered when the test says
		arrived <- text
		<-release[text]
		io.WriteString(w, `{"choices":[{"index":0,"message":{"content":""},"finish_reason":"length"}],`+
			`"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[1]}}`)
	}, nil)
	answers := make(chan string, 2)
	for _, text := range []string{"a", "b"} {
		go func() {
			response, body := u.post(t, strings.Replace(chatBody, `"hi"`, `"`+text+`"`, 1))
			answers <- text + ":" + response.Status + ":" + body
		}()
	}
	<-arrived
	<-arrived // both routed, neither decoding
	close(release["a"])
	<-aDecoding
	close(release["b"])
	if got := <-answers; !strings.HasPrefix(got, "b:200") {
		t.Fatalf("b answered %s", got)
	}
	close(aFinish)
	if got := <-answers; !strings.HasPrefix(got, "a:200") {
		t.Fatalf("a answered %s", got)
	}
	if strings.Join(decodedOn, " ") != "other:b first:a" {
		t.Fatalf("decoded %v, want b on the other engine while a's decode held the first", decodedOn)
	}
}
