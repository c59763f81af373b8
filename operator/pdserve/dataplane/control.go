package main

// The control API. Loopback is no boundary (every process in the pod reaches it: a sidecar, a
// debug shell), and a routing table decides who may call the gateway at all, so every call
// presents the token the Python gateway started the data plane with.

import (
	"crypto/sha256"
	"crypto/subtle"
	"net/http"
	"net/http/pprof"
	"strings"
)

// tokenVariable is where the Python gateway passes the data plane its token.
const tokenVariable = "PDSERVE_DATAPLANE_TOKEN"

// controlAPI: PUT /table, GET /stats, POST /drain (drain is called), GET /health and the
// profiles, each behind the token.
func (p *plane) controlAPI(token string, drain func()) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("PUT /table", p.putTable)
	mux.HandleFunc("GET /stats", p.getStats)
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
	mux.Handle("GET /debug/pprof/allocs", pprof.Handler("allocs"))
	mux.HandleFunc("POST /drain", func(w http.ResponseWriter, _ *http.Request) {
		drain()
		w.WriteHeader(http.StatusNoContent)
	})
	return withToken(token, mux)
}

// withToken lets through only calls with Authorization: Bearer <token>, compared as digests in
// constant time (the time taken says nothing about how much of a guess was right).
func withToken(token string, next http.Handler) http.Handler {
	want := sha256.Sum256([]byte(token))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		scheme, presented, _ := strings.Cut(r.Header.Get("Authorization"), " ")
		got := sha256.Sum256([]byte(strings.TrimSpace(presented)))
		if token == "" || !strings.EqualFold(scheme, "bearer") ||
			subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
			w.Header().Set("WWW-Authenticate", "Bearer")
			http.Error(w, "the data plane's control API needs Authorization: Bearer <token>, the "+
				tokenVariable+" the Python gateway started it with", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}
