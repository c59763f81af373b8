package main

// The routing table: what the Python gateway (the policy) decided, pushed here whenever it
// changes. The data plane never decides a route on its own: a model it has no route for, or a
// request it cannot serve as the table says, goes to the Python gateway. Upstream failures are
// answered with the Python gateway's retries, fallbacks and words (failures.go).

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// Route names what the fast path does with a model's requests.
const (
	routePD     = "pd"     // prefill with a remote-decode handoff, then decode
	routeDecode = "decode" // straight to decode (Aggregated, or no prefill may serve)
	// No complete set of engines: each request waits for a table with one, then 503.
	routeUnavailable = "unavailable"
	// Served behind render servers: render -> P/D -> derender, or render -> decode -> derender.
	routeRenderPD     = "render_pd"
	routeRenderDecode = "render_decode"
)

type tableJSON struct {
	Version       int64                `json:"version"`
	Models        map[string]modelJSON `json:"models"`
	APIKeyDigests []string             `json:"apiKeySha256"`
	PassAuth      bool                 `json:"passAuthorization"`
	MaxTokensCap  int64                `json:"maxTokensCap"`
	LongBodyBytes int64                `json:"longBodyBytes"`
	LongTokens    int64                `json:"longPromptTokens"`
	TokensOnly    bool                 `json:"tokensOnlyEngines"`
	Pipelining    bool                 `json:"derenderPipelining"`
	Load          map[string]float64   `json:"load"`
	Admission     admissionJSON        `json:"admission"`
	RequestLog    *requestLogJSON      `json:"requestLog"` // absent: no request log is kept
	Placement     *placementJSON       `json:"placement"`  // absent: engines picked by load alone
}

// admissionJSON: how this replica's fair admission queue runs (fairqueue.go). Absent (a zero
// limit): every long prompt asks the Python gateway, as when another replica leads.
type admissionJSON struct {
	MaxLongPerReplica int            `json:"maxLongPerReplica"`
	MaxWaitSeconds    float64        `json:"maxWaitSeconds"`
	LeaderElsewhere   bool           `json:"leaderElsewhere"` // another gateway replica admits: ask the Python gateway
	Others            map[string]int `json:"others"`          // peers' own long prefills per replica
}

type modelJSON struct {
	Route  string      `json:"route"`
	Groups []groupJSON `json:"groups"`
	// Render servers: the engines take token ids, the route renders and derenders around them.
	Render []string `json:"render"`
	// Routing mode Auto (route auto): what each request is decided by (auto.go).
	Auto *autoJSON `json:"auto"`
	// The parity hash of the engines it routes to (the request log's parity_hash).
	ParityHash string `json:"parityHash"`
	// Token ids per block of the prefix index (placement.go): the engines' KV block size.
	BlockSize int `json:"blockSize"`
	// How long after prefill's answer a decode may still be sent its KV (the routing config's
	// prefill lease less the gateway's margin; may be negative); absent: no bound.
	KVStartWithinSeconds *float64 `json:"kvStartWithinSeconds"`
	// Bidirectional KV (bidirectional.go); absent: decode holds nothing for a next turn.
	Bidirectional *bidirectionalJSON `json:"bidirectional"`
	// Route unavailable: how long a request waits for engines, and the 503's words after.
	Unavailable *unavailableJSON `json:"unavailable"`
	// Every request prefills on decode for this reason (no prefill replica may take P/D:
	// its transport not Verified, no KV-compatible decode), counted as the Python gateway's
	// fallback of that name.
	LocalPrefillReason string `json:"localPrefillReason"`
}

type unavailableJSON struct {
	Message     string  `json:"message"`
	WaitSeconds float64 `json:"waitSeconds"`
}

// groupJSON: engines that can hand KV to each other (one KV-compatibility digest).
type groupJSON struct {
	Prefill []string `json:"prefill"`
	Decode  []string `json:"decode"`
}

// endpoint is one engine, or one data-parallel rank of one (`<url>#dp<n>` in the table); its
// in-flight count survives table updates (same key, same state).
type endpoint struct {
	url      string // the server: failures name it, admission slots and retries go by it
	key      string // as the table names it: the URL, with the rank if any
	at       endpointURL
	base     atomic.Uint64 // float64 bits: the Python gateway's view of its load (scraped)
	inflight atomic.Int64
	// Prompt tokens this data plane sent it that have no first token yet: prefill work queued
	// there, which a request count alone hides (upstream.counted).
	backlog  atomic.Int64
	perUnit  atomic.Uint64 // float64 bits: placementJSON.TokensPerLoadUnit (0: not weighed)
	served   atomic.Int64
	steps    stepMeter   // routing mode Auto: its streams' time between tokens
	prefixes prefixCache // the block hashes of the prompts it prefilled lately
}

type group struct {
	prefill, decode []*endpoint
}

type model struct {
	route     string
	groups    []group
	render    []*endpoint
	auto      *autoJSON // route auto only
	parity    string
	blockSize int
	// kvStartWithin: a decode is sent prefill's KV only this long after prefill answered
	// (hops.kv_start_by); bounded false: no bound.
	kvStartWithin time.Duration
	bounded       bool
	bidi          *bidirectionalJSON // nil: no bidirectional KV
	unavailable   string             // route unavailable: the 503's message
	wait          time.Duration      // route unavailable: how long a request waits for engines
	localReason   string             // every request prefills on decode, counted so
	// Every prefill and every decode engine of the groups, each once, in the table's order.
	prefills, decodes []*endpoint
}

type table struct {
	version            int64
	models             map[string]*model
	keys               [][]byte // sha256 digests of the API keys
	passAuth           bool
	maxTokensCap       int64
	longBody           int64 // larger bodies are long prompts: fair admission
	longTokens         int64 // behind render servers: prompts of this many tokens or more are long
	tokensOnly         bool  // the engines run --tokens-only: some parameters are refused (refusals.go)
	derenderPipelining bool
	admission          admissionSettings
	admitHere          bool // this replica's queue runs here; else ask the Python gateway
	requestLog         *requestLogJSON
	placement          *placementJSON // nil: engines picked by load alone
}

// build validates a pushed table; engines are shared with the previous table by URL.
func build(raw []byte, known map[string]*endpoint) (*table, map[string]*endpoint, error) {
	var in tableJSON
	if err := json.Unmarshal(raw, &in); err != nil {
		return nil, nil, fmt.Errorf("routing table: %w", err)
	}
	t := &table{version: in.Version, models: map[string]*model{}, passAuth: in.PassAuth,
		maxTokensCap: in.MaxTokensCap, longBody: in.LongBodyBytes, longTokens: in.LongTokens,
		tokensOnly:         in.TokensOnly,
		derenderPipelining: in.Pipelining, requestLog: in.RequestLog, placement: in.Placement}
	if err := validPlacement(in.Placement); err != nil {
		return nil, nil, err
	}
	if in.RequestLog != nil {
		if err := validRequestLog(in.RequestLog); err != nil {
			return nil, nil, err
		}
	}
	if a := in.Admission; a.MaxLongPerReplica < 0 || a.MaxWaitSeconds < 0 || math.IsNaN(a.MaxWaitSeconds) {
		return nil, nil, fmt.Errorf("routing table: admission: maxLongPerReplica and maxWaitSeconds must not be negative")
	}
	t.admitHere = in.Admission.MaxLongPerReplica > 0 && !in.Admission.LeaderElsewhere
	t.admission = admissionSettings{limit: in.Admission.MaxLongPerReplica,
		maxWait: time.Duration(in.Admission.MaxWaitSeconds * float64(time.Second)), others: in.Admission.Others}
	for _, digest := range in.APIKeyDigests {
		key, err := hex.DecodeString(digest)
		if err != nil || len(key) != sha256.Size {
			return nil, nil, fmt.Errorf("routing table: apiKeySha256: %q is not a hex SHA-256", digest)
		}
		t.keys = append(t.keys, key)
	}
	next := map[string]*endpoint{}
	engine := func(key string) (*endpoint, error) {
		e := next[key] // one engine listed twice (in two groups) is one engine
		if e == nil {
			e = known[key]
		}
		if e == nil {
			at, err := parseEndpoint(key)
			if err != nil {
				return nil, err
			}
			server, _, _ := strings.Cut(key, "#")
			e = &endpoint{url: server, key: key, at: at}
		}
		next[key] = e
		e.base.Store(math.Float64bits(in.Load[key]))
		if in.Placement != nil {
			e.perUnit.Store(math.Float64bits(in.Placement.TokensPerLoadUnit))
		}
		return e, nil
	}
	for name, m := range in.Models {
		switch m.Route {
		case routePD, routeDecode, routeUnavailable:
		case routeAuto:
			if m.Auto == nil {
				return nil, nil, fmt.Errorf("routing table: models.%s has route auto but no auto", name)
			}
		default:
			return nil, nil, fmt.Errorf("routing table: models.%s.route %q is not pd, decode, auto or unavailable", name, m.Route)
		}
		if m.BlockSize < 0 {
			return nil, nil, fmt.Errorf("routing table: models.%s.blockSize %d is negative", name, m.BlockSize)
		}
		if err := validBidirectional(name, m.Bidirectional, m.BlockSize); err != nil {
			return nil, nil, err
		}
		out := &model{route: m.Route, auto: m.Auto, parity: m.ParityHash, blockSize: m.BlockSize,
			bidi: m.Bidirectional, localReason: m.LocalPrefillReason}
		if m.Route == routeUnavailable {
			out.unavailable = "no complete set of engines"
			if u := m.Unavailable; u != nil {
				if u.WaitSeconds < 0 || math.IsInf(u.WaitSeconds, 0) {
					return nil, nil, fmt.Errorf("routing table: models.%s.unavailable.waitSeconds must be finite and not negative", name)
				}
				out.wait = time.Duration(u.WaitSeconds * float64(time.Second))
				if u.Message != "" {
					out.unavailable = u.Message
				}
			}
		}
		if within := m.KVStartWithinSeconds; within != nil { // JSON has no NaN nor infinity
			out.kvStartWithin, out.bounded = time.Duration(*within*float64(time.Second)), true
		}
		if m.Route != routeUnavailable {
			for _, url := range m.Render {
				e, err := engine(url)
				if err != nil {
					return nil, nil, err
				}
				out.render = append(out.render, e)
			}
		}
		for i, g := range m.Groups {
			var built group
			for _, url := range g.Prefill {
				e, err := engine(url)
				if err != nil {
					return nil, nil, err
				}
				built.prefill = append(built.prefill, e)
			}
			for _, url := range g.Decode {
				e, err := engine(url)
				if err != nil {
					return nil, nil, err
				}
				built.decode = append(built.decode, e)
			}
			if len(built.decode) == 0 || (m.Route == routePD && len(built.prefill) == 0) {
				return nil, nil, fmt.Errorf("routing table: models.%s.groups[%d] lacks the engines route %s needs", name, i, m.Route)
			}
			out.add(built)
		}
		if m.Route != routeUnavailable && len(out.groups) == 0 {
			return nil, nil, fmt.Errorf("routing table: models.%s has route %s but no groups", name, m.Route)
		}
		t.models[name] = out
	}
	return t, next, nil
}

// add appends a group, its engines to the model's prefill and decode engines (each once).
func (m *model) add(g group) {
	m.groups = append(m.groups, g)
	for _, e := range g.prefill {
		if !slices.Contains(m.prefills, e) {
			m.prefills = append(m.prefills, e)
		}
	}
	for _, e := range g.decode {
		if !slices.Contains(m.decodes, e) {
			m.decodes = append(m.decodes, e)
		}
	}
}

// authorized: no keys configured, or the Bearer token is one of them (compared as digests,
// against every key, so the time taken says nothing about which one is close).
func (t *table) authorized(header string) bool {
	if len(t.keys) == 0 {
		return true
	}
	scheme, token, _ := strings.Cut(header, " ")
	token = strings.TrimSpace(token)
	if !strings.EqualFold(scheme, "bearer") || token == "" {
		return false
	}
	digest := sha256.Sum256([]byte(token))
	matched := 0
	for _, key := range t.keys {
		matched |= subtle.ConstantTimeCompare(digest[:], key)
	}
	return matched == 1
}

// load ranks engines as the Python gateway does (Endpoint.load): its scraped view plus this
// data plane's own requests in flight and prompt tokens not prefilled yet (which move at once,
// between scrapes).
func (e *endpoint) load() float64 {
	load := math.Float64frombits(e.base.Load()) + float64(e.inflight.Load())
	if perUnit := math.Float64frombits(e.perUnit.Load()); perUnit > 0 {
		load += float64(e.backlog.Load()) / perUnit
	}
	return load
}

// owe counts `tokens` of prompt to prefill on e until the returned prefilled is called (again:
// nothing), as upstream.counted does for the Python gateway's picks.
func (e *endpoint) owe(tokens int64) (prefilled func()) {
	if tokens <= 0 {
		return func() {}
	}
	e.backlog.Add(tokens)
	return func() { e.backlog.Add(-tokens); tokens = 0 }
}

// least is the least loaded engine.
func least(engines []*endpoint) *endpoint {
	var best *endpoint
	for _, e := range engines {
		if best == nil || e.load() < best.load() {
			best = e
		}
	}
	return best
}

// pick: for P/D the best prefill of all groups (its prefix cache counting), then the best
// decode of its group (one that can pull its KV); straight to decode the best decode of all,
// its own prefix cache counting (placement.go; nil w: the least loaded).
func (m *model) pick(w *placing) (prefill, decode *endpoint) {
	if m.route == routePD {
		prefill = w.pick("prefill", m.prefills, true)
		return prefill, m.decodeFor(prefill, w)
	}
	return nil, w.pick("decode", m.decodes, true)
}

// rankedPrefill: every prefill replica (or rank) of the model, `best` first, then as pick
// would choose them; with `only`, those of these servers alone (Auto mode's P/D through the
// replicas whose KV path fits).
func (m *model) rankedPrefill(best *endpoint, only []string, w *placing) []*endpoint {
	var rest []*endpoint
	for _, e := range m.prefills {
		if e != best && (len(only) == 0 || slices.Contains(only, e.url)) {
			rest = append(rest, e)
		}
	}
	return append([]*endpoint{best}, w.rank("prefill", rest, true)...)
}

// otherPrefills: a failed prefill's retries, best first: the model's prefill replicas on
// other servers (a server that failed a request fails it on every rank, as the Python
// gateway holds).
func (m *model) otherPrefills(failed *endpoint, only []string, w *placing) []*endpoint {
	var others []*endpoint
	for _, e := range m.rankedPrefill(failed, only, w)[1:] {
		if e.url != failed.url {
			others = append(others, e)
		}
	}
	return others
}

// decodeFor: the best decode replica that can pull `prefill`'s KV (its own prefix cache does
// not count: the KV comes from prefill).
func (m *model) decodeFor(prefill *endpoint, w *placing) *endpoint {
	for i := range m.groups {
		for _, e := range m.groups[i].prefill {
			if e == prefill {
				return w.pick("decode", m.groups[i].decode, false)
			}
		}
	}
	return nil
}

// otherDecodes: the model's decode replicas on other servers than `e`'s, best first (a
// retry's, which mostly prefills itself).
func (m *model) otherDecodes(e *endpoint, w *placing) []*endpoint {
	var others []*endpoint
	for _, d := range m.decodes {
		if d.url != e.url {
			others = append(others, d)
		}
	}
	return w.rank("decode", others, true)
}
