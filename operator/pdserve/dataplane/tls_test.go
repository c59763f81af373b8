package main

import (
	"crypto/x509"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

const tlsAnswer = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m",` +
	`"choices":[{"index":0,"message":{"role":"assistant","content":"over TLS"},"finish_reason":"stop"}],` +
	`"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}`

// tlsEngine: an engine served over TLS with a certificate of its own test authority, counting
// the connections opened to it and whether each request came over TLS.
func tlsEngine(t *testing.T) (server *httptest.Server, opened, plain *atomic.Int64) {
	t.Helper()
	opened, plain = new(atomic.Int64), new(atomic.Int64)
	server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.TLS == nil {
			plain.Add(1)
		}
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, tlsAnswer)
	}))
	server.Config.ConnState = func(_ net.Conn, state http.ConnState) {
		if state == http.StateNew {
			opened.Add(1)
		}
	}
	server.StartTLS()
	t.Cleanup(server.Close)
	return server, opened, plain
}

// An engine behind https:// is served by the data plane itself, its certificate checked, its
// connection kept for the next request as a plain one is: nothing handed to the Python gateway.
func TestAnHTTPSEngineIsServedOverTLSAndItsConnectionReused(t *testing.T) {
	engine, opened, plain := tlsEngine(t)
	roots := x509.NewCertPool()
	roots.AddCert(engine.Certificate())
	table := strings.ReplaceAll(decodeTable, "URL", engine.URL)
	u := newPlaneUnderTest(t, table, nil, func(p *plane) { p.upstream.tls.RootCAs = roots })
	for range 3 {
		response, text := u.post(t, chatBody)
		var answer struct {
			Choices []struct{ Message struct{ Content string } }
		}
		if err := json.Unmarshal([]byte(text), &answer); err != nil || response.StatusCode != 200 ||
			len(answer.Choices) != 1 || answer.Choices[0].Message.Content != "over TLS" {
			t.Fatalf("%d %s", response.StatusCode, text)
		}
	}
	if len(u.python.seen()) != 0 {
		t.Fatal("handed over to the Python gateway")
	}
	if plain.Load() != 0 || opened.Load() != 1 {
		t.Fatalf("%d plain requests, %d connections for 3 requests in turn", plain.Load(), opened.Load())
	}
}

// An engine whose certificate the data plane does not trust is never sent the request: the
// client is answered an error naming no address (as any unreachable engine), not handed over.
func TestAnHTTPSEngineWithAnUntrustedCertificateIsNotSentTheRequest(t *testing.T) {
	engine, _, _ := tlsEngine(t)
	var served atomic.Int64
	engine.Config.Handler = http.HandlerFunc(func(http.ResponseWriter, *http.Request) { served.Add(1) })
	table := strings.ReplaceAll(decodeTable, "URL", engine.URL)
	u := newPlaneUnderTest(t, table, nil, func(p *plane) { p.upstream.tls.RootCAs = x509.NewCertPool() })
	response, text := u.post(t, chatBody)
	var answer struct{ Error struct{ Message string } }
	json.Unmarshal([]byte(text), &answer)
	want := "decode at a replica: ClientConnectorCertificateError: certificate verify failed: x509: certificate signed by unknown authority"
	if response.StatusCode != 502 || answer.Error.Message != want {
		t.Fatalf("%d %s", response.StatusCode, text)
	}
	if served.Load() != 0 || len(u.python.seen()) != 0 {
		t.Fatalf("engine served %d, python %d", served.Load(), len(u.python.seen()))
	}
}

// The table names an engine by its URL: https:// is TLS on port 443 unless one is given.
func TestAnHTTPSEngineURLIsTLSOnItsPortOr443(t *testing.T) {
	for raw, want := range map[string]endpointURL{
		"https://decode.example":       {host: "decode.example:443", secure: true, serverName: "decode.example", pool: "tls:decode.example:443", name: "decode.example"},
		"https://10.0.0.9:8443/v1#dp1": {host: "10.0.0.9:8443", secure: true, serverName: "10.0.0.9", pool: "tls:10.0.0.9:8443", name: "10.0.0.9:8443", base: "/v1", rank: "1"},
		"http://decode.example":        {host: "decode.example:80", serverName: "decode.example", pool: "decode.example:80", name: "decode.example"},
	} {
		got, err := parseEndpoint(raw)
		if err != nil || got != want {
			t.Errorf("%s: %+v %v, want %+v", raw, got, err, want)
		}
	}
	if _, err := parseEndpoint("ftp://decode.example"); err == nil {
		t.Error("ftp:// accepted")
	}
}

// An engine that closed an idle TLS connection (a restart, its idle timeout) costs the next
// request nothing: it goes over a new connection.
func TestAnHTTPSEngineThatClosedItsIdleConnectionGetsTheNextRequestOnANewOne(t *testing.T) {
	engine, opened, _ := tlsEngine(t)
	roots := x509.NewCertPool()
	roots.AddCert(engine.Certificate())
	u := newPlaneUnderTest(t, strings.ReplaceAll(decodeTable, "URL", engine.URL), nil,
		func(p *plane) { p.upstream.tls.RootCAs = roots })
	for i := range 2 {
		if response, text := u.post(t, chatBody); response.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, response.StatusCode, text)
		}
		engine.CloseClientConnections()
	}
	if opened.Load() != 2 {
		t.Fatalf("%d connections", opened.Load())
	}
}
