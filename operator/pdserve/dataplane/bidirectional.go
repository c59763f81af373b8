package main

// Bidirectional KV, as the Python gateway keeps it (gateway/held_kv.py, affinity.DecodeKv,
// tokens_route.py). With vLLM's bidirectional_kv_xfer a decode engine keeps the blocks of every
// P/D request it finished stopped or length-capped for a TTL, so that a conversation's next
// prefill can read them back instead of computing them again. The data plane keeps:
//   - per conversation, the KV its last non-streamed turn left on decode (turnStore), pointed
//     at by the next turn's prefill as far as the token ids still match, in whole blocks;
//   - per decode server, the blocks its finished P/D requests hold there, and its P/D requests
//     still decoding (holdStore), within a budget: a fraction of the replica's KV blocks,
//     shared among the gateway replicas. Past it a request prefills locally on decode, which
//     holds nothing, instead of filling decode's cache with holds that stall its admission.
// The numbers come with the routing table; the shared cases (testdata/bidirectional_cases.json)
// hold both sides to the same decisions and bodies.

import (
	"bytes"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"
)

// bidirectionalJSON: a model's bidirectional KV, as the Python gateway pushes it
// (fastpath.bidirectional_table); absent: the model's engines hold nothing for a next turn.
type bidirectionalJSON struct {
	TTLSeconds       float64 `json:"ttlSeconds"` // decoder_kv_blocks_ttl: how long decode holds
	Fraction         float64 `json:"fraction"`   // of a decode replica's KV blocks the holds may take
	GatewayReplicas  int     `json:"gatewayReplicas"`
	MaxConversations int     `json:"maxConversations"`
	MaxHolds         int     `json:"maxHolds"` // per decode server
	// Per decode engine (as the table names it): its KV blocks and block size, once scraped;
	// an engine not named takes P/D as if its holds always fit.
	Capacity map[string]kvCapacity `json:"capacity"`
	// Per decode server: blocks held there for requests the Python gateway served itself.
	HeldElsewhere map[string]int `json:"heldElsewhere"`
}

type kvCapacity struct {
	Blocks    int `json:"blocks"`
	BlockSize int `json:"blockSize"`
}

func validBidirectional(name string, b *bidirectionalJSON, blockSize int) error {
	if b == nil {
		return nil
	}
	finite := func(x float64) bool { return x >= 0 && !math.IsInf(x, 0) }
	if !finite(b.TTLSeconds) || !finite(b.Fraction) || b.Fraction > 1 || b.GatewayReplicas < 0 ||
		b.MaxConversations < 0 || b.MaxHolds < 0 {
		return fmt.Errorf("routing table: models.%s.bidirectional: ttlSeconds, fraction (at most 1), gatewayReplicas, maxConversations and maxHolds must be finite and not negative", name)
	}
	if blockSize <= 0 {
		return fmt.Errorf("routing table: models.%s has bidirectional KV but no blockSize: send the engines' KV block size", name)
	}
	for key, c := range b.Capacity {
		if c.Blocks < 0 || c.BlockSize < 0 {
			return fmt.Errorf("routing table: models.%s.bidirectional.capacity[%q]: blocks and blockSize must not be negative", name, key)
		}
	}
	return nil
}

// heldFinishReasons: the finish reasons after which decode holds a P/D request's blocks (vLLM's
// FINISHED_STOPPED, FINISHED_LENGTH_CAPPED); an aborted or failed one frees them at once.
var heldFinishReasons = map[string]bool{`"stop"`: true, `"length"`: true}

// blocksOf: the KV blocks `tokens` take at `size` tokens a block (held_kv.DecodeHolds.blocks).
func blocksOf(tokens, size int) int {
	if tokens <= 0 {
		return 0
	}
	return max(1, (tokens+size-1)/size)
}

// ---- what each decode server holds -----------------------------------------------------------

type holdEntry struct {
	id      string
	expires time.Time
}

type serverHolds struct {
	queue []holdEntry    // oldest first: with one TTL the expired ones lead
	live  map[string]int // request id -> the blocks it still holds (released ones gone)
	sum   int
}

// holdStore: per decode server, the blocks this data plane's finished P/D requests hold
// there; and the P/D requests still decoding, at the blocks each may hold when it finishes.
type holdStore struct {
	mu       sync.Mutex
	servers  map[string]*serverHolds
	inflight map[string]int
	pending  int
	now      func() time.Time // time.Now; a test's clock
}

func (h *holdStore) clock() time.Time {
	if h.now != nil {
		return h.now()
	}
	return time.Now()
}

// heldLocked: blocks server `url` holds now, the expired holds dropped first.
func (h *holdStore) heldLocked(url string, now time.Time) int {
	s := h.servers[url]
	if s == nil {
		return 0
	}
	for len(s.queue) > 0 && !s.queue[0].expires.After(now) {
		s.drop(0)
	}
	return s.sum
}

// drop forgets the i-th oldest hold (0, or the oldest past the bound).
func (s *serverHolds) drop(i int) {
	if blocks, ok := s.live[s.queue[i].id]; ok {
		s.sum -= blocks
		delete(s.live, s.queue[i].id)
	}
	s.queue = append(s.queue[:i], s.queue[i+1:]...)
}

// room: the decode engines a P/D request that may hold `tokens` (prompt + max_tokens, for
// every choice) fits on (held_kv.DecodeHolds.room): where its hold, the holds there (this data
// plane's and the Python gateway's) and the P/D requests still decoding (counted against
// every candidate: where each lands is the picker's choice) stay within the budget. Engines
// whose capacity is not known yet always fit. With `reserve`, the request's hold is reserved
// (at the most it may take on any of them) until settle.
func (h *holdStore) room(b *bidirectionalJSON, blockSize int, decodes []*endpoint, tokens int,
	reserve string) []*endpoint {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.clock()
	var fits []*endpoint
	most := 0
	for _, e := range decodes {
		c := b.Capacity[e.key]
		size := blockSize
		if c.BlockSize > 0 {
			size = c.BlockSize
		}
		need := blocksOf(tokens, size)
		if c.Blocks > 0 {
			budget := int(b.Fraction * float64(c.Blocks) / float64(max(1, b.GatewayReplicas)))
			if h.heldLocked(e.url, now)+b.HeldElsewhere[e.url]+h.pending+need > budget {
				continue
			}
		}
		fits = append(fits, e)
		most = max(most, need)
	}
	if reserve != "" && len(fits) > 0 {
		if h.inflight == nil {
			h.inflight = map[string]int{}
		}
		h.pending += most - h.inflight[reserve]
		h.inflight[reserve] = most
	}
	return fits
}

// settle: the P/D request `id` is over. With `url`, the decode server that pulled its KV holds
// each finished choice (prompt + answer tokens, `size` a block) for the TTL; without, nothing.
func (h *holdStore) settle(id, url string, tokens []int, size int, b *bidirectionalJSON) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.pending -= h.inflight[id]
	delete(h.inflight, id)
	if url == "" {
		return
	}
	blocks := 0
	for _, count := range tokens {
		blocks += blocksOf(count, size)
	}
	if blocks == 0 {
		return
	}
	if h.servers == nil {
		h.servers = map[string]*serverHolds{}
	}
	s := h.servers[url]
	if s == nil {
		s = &serverHolds{live: map[string]int{}}
		h.servers[url] = s
	}
	ttl := time.Duration(b.TTLSeconds * float64(time.Second))
	s.queue = append(s.queue, holdEntry{id: id, expires: h.clock().Add(ttl)})
	s.live[id] += blocks
	s.sum += blocks
	for b.MaxHolds > 0 && len(s.queue) > b.MaxHolds {
		s.drop(0)
	}
}

// released: a next turn's prefill read the hold back, which frees it on the engine.
func (h *holdStore) released(url, id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if s := h.servers[url]; s != nil {
		if blocks, ok := s.live[id]; ok {
			s.sum -= blocks
			delete(s.live, id)
		}
	}
}

// snapshot: per decode server, the blocks held there now (for /stats: the Python gateway's
// budget and its held-blocks gauge count them).
func (h *holdStore) snapshot() map[string]int {
	h.mu.Lock()
	defer h.mu.Unlock()
	now, out := h.clock(), map[string]int{}
	for url := range h.servers {
		if held := h.heldLocked(url, now); held > 0 {
			out[url] = held
		}
	}
	return out
}

// ---- what each conversation's last turn left on decode ---------------------------------------

// heldTurn: the KV a conversation's last decode turn left on its decode server.
type heldTurn struct {
	params    []byte  // decode's kv_transfer_params, as it answered them
	tokens    []int64 // the turn's prompt and answer
	expires   time.Time
	decodeURL string // only a prefill that can pull from this server can read it
	requestID string // its hold in the holdStore
}

type turnStore struct {
	mu    sync.Mutex
	turns *lru[string, heldTurn]
	now   func() time.Time
}

func (s *turnStore) clock() time.Time {
	if s.now != nil {
		return s.now()
	}
	return time.Now()
}

// keep: decode answered the conversation's turn with where its KV is held.
func (s *turnStore) keep(conversation string, turn heldTurn, ttl time.Duration, limit int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.turns == nil {
		s.turns = newLRU[string, heldTurn]()
	}
	turn.expires = s.clock().Add(ttl)
	s.turns.put(conversation, turn, limit)
}

// reuse: what the conversation's last turn left that this prompt may read back
// (affinity.DecodeKv.reuse): the outcome (none, expired, prefix_mismatch: fewer than
// minTokens agree, reused) and how many leading tokens agree.
func (s *turnStore) reuse(conversation string, prompt []int64, minTokens int) (heldTurn, string, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.turns == nil {
		return heldTurn{}, "none", 0
	}
	turn, ok := s.turns.get(conversation)
	if !ok || turn.params == nil {
		return heldTurn{}, "none", 0
	}
	if !turn.expires.After(s.clock()) {
		s.turns.set(conversation, heldTurn{})
		return heldTurn{}, "expired", 0
	}
	matched := 0
	for matched < len(prompt) && matched < len(turn.tokens) && prompt[matched] == turn.tokens[matched] {
		matched++
	}
	if matched < minTokens {
		return heldTurn{}, "prefix_mismatch", matched
	}
	return turn, "reused", matched
}

// consumed: the turn `requestID` left was read back by a next prefill, which frees its blocks
// on decode: nothing of it is left to point another prefill at.
func (s *turnStore) consumed(conversation, requestID string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.turns == nil {
		return
	}
	if turn, ok := s.turns.get(conversation); ok && turn.requestID == requestID {
		s.turns.set(conversation, heldTurn{})
	}
}

// ---- the bodies -------------------------------------------------------------------------------

var reuseDrops = map[string]bool{"do_remote_decode": true, "do_remote_prefill": true,
	"remote_num_tokens": true, "remote_block_ids": true}

// reuseParams: kv_transfer_params pointing prefill at the KV decode holds of the last turn,
// still asking it to hand off to decode (protocol.reuse_decode_kv_params). Prefill loads the
// first remote_num_tokens of its prompt from those blocks without comparing tokens, so they are
// cut to the whole blocks of the prefix the new prompt shares with the held turn.
func reuseParams(held []byte, matched, blockSize int) ([]byte, error) {
	fields, err := topLevel(held)
	if err != nil {
		return nil, err
	}
	usable := min(numberOf(lookup(fields, "remote_num_tokens")), matched)
	blocks := usable / blockSize
	var out bytes.Buffer
	splice(&out, held, fields, reuseDrops, []field{
		{"do_remote_decode", []byte("true")}, {"do_remote_prefill", []byte("false")},
		{"remote_num_tokens", strconv.AppendInt(nil, int64(blocks*blockSize), 10)},
		{"remote_block_ids", firstBlocks(lookup(fields, "remote_block_ids"), blocks)}})
	return out.Bytes(), nil
}

// numberOf: a JSON number as Python's int() reads it (null, absent or not a number: 0).
func numberOf(raw []byte) int {
	f, err := strconv.ParseFloat(string(raw), 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0
	}
	return int(f)
}

// firstBlocks: the first `count` block ids, of one list or of each KV cache group's list.
func firstBlocks(ids []byte, count int) []byte {
	if ids == nil {
		return []byte("null")
	}
	elements, err := arrayElements(ids)
	if err != nil {
		return ids
	}
	groups := len(elements) > 0
	for _, at := range elements {
		groups = groups && ids[at.start] == '['
	}
	if !groups {
		return joinElements(ids, elements[:min(count, len(elements))])
	}
	var out bytes.Buffer
	out.WriteByte('[')
	for i, at := range elements {
		if i > 0 {
			out.WriteByte(',')
		}
		group := ids[at.start:at.end]
		inner, err := arrayElements(group)
		if err != nil {
			out.Write(group)
			continue
		}
		out.Write(joinElements(group, inner[:min(count, len(inner))]))
	}
	out.WriteByte(']')
	return out.Bytes()
}

func joinElements(raw []byte, elements []span) []byte {
	var out bytes.Buffer
	out.WriteByte('[')
	for i, at := range elements {
		if i > 0 {
			out.WriteByte(',')
		}
		out.Write(raw[at.start:at.end])
	}
	out.WriteByte(']')
	return out.Bytes()
}

// tokenIDs: a JSON array of token ids as numbers; false when it is not one.
func tokenIDs(raw []byte) ([]int64, bool) {
	elements, err := arrayElements(raw)
	if err != nil {
		return nil, false
	}
	out := make([]int64, len(elements))
	for i, at := range elements {
		n, err := strconv.ParseInt(string(raw[at.start:at.end]), 10, 64)
		if err != nil {
			return nil, false
		}
		out[i] = n
	}
	return out, true
}

// ---- one request ------------------------------------------------------------------------------

// bidiRequest: one P/D request's part in its model's bidirectional KV.
type bidiRequest struct {
	id           string
	conversation string // "" when the request names none: nothing is kept for a next turn
	reused       *heldTurn
	decodedOn    *endpoint // the decode engine that answered
	pulled       bool      // it was sent prefill's KV (and loaded it): it holds the blocks now
	held         []int     // per choice finished stopped or length-capped: prompt + answer tokens
}

// holdRoom narrows a P/D request's engines to the decode engines its hold fits on (and the
// prefill engines that pair with them), its hold reserved until settle (tokens_route.py
// admit_hold); nil when none has room: it prefills locally on decode, which holds nothing.
func (p *plane) holdRoom(m *model, paramFields []member, promptTokens int, id, conversation string) (*model, *bidiRequest) {
	choices := max(1, numberOf(lookup(paramFields, "n")))
	tokens := (promptTokens + numberOf(lookup(paramFields, "max_tokens"))) * choices
	fits := p.holds.room(m.bidi, m.blockSize, m.decodes, tokens, id) // reserved if any fits
	if len(fits) == 0 {
		p.stats.localPrefill("decode_kv_held")
		return nil, nil
	}
	narrowed := m.narrowed(func(e *endpoint) bool { return slices.Contains(fits, e) },
		func(*group) bool { return true })
	if len(narrowed.prefills) == 0 { // only decode engines no prefill pairs with have room
		p.holds.settle(id, "", nil, 0, m.bidi)
		p.stats.localPrefill("decode_kv_held")
		return nil, nil
	}
	return narrowed, &bidiRequest{id: id, conversation: conversation}
}

// handoff: the prefill's kv_transfer_params (tokens_route.py bidirectional_handoff). When the
// conversation's last turn left its KV on decode, the token ids still agree for at least a
// block, the decode server holding it is still routable and a prefill engine can pull from it
// (then only those may: another KV-compatibility digest or slice could not), prefill is pointed
// at it; m narrowed to those.
func (p *plane) handoff(m *model, b *bidiRequest, tokens []byte, s *served) (*model, []byte) {
	if b.conversation == "" {
		return m, handoff
	}
	prompt, ok := tokenIDs(tokens)
	if !ok {
		return m, handoff
	}
	turn, outcome, matched := p.turns.reuse(b.conversation, prompt, m.blockSize)
	if outcome == "reused" {
		holder := func(g *group) bool {
			return len(g.prefill) > 0 && slices.ContainsFunc(g.decode, func(e *endpoint) bool {
				return e.url == turn.decodeURL
			})
		}
		narrowed := m.narrowed(func(*endpoint) bool { return true }, holder)
		switch {
		case !slices.ContainsFunc(m.decodes, func(e *endpoint) bool { return e.url == turn.decodeURL }):
			outcome = "decode_gone"
		case len(allowedPrefills(narrowed, s)) == 0:
			outcome = "incompatible"
		default:
			m = narrowed
		}
	}
	if outcome != "none" {
		p.stats.reused(outcome)
	}
	if outcome != "reused" {
		return m, handoff
	}
	params, err := reuseParams(turn.params, matched, m.blockSize)
	if err != nil {
		return m, handoff // never: kept only when it was a JSON object
	}
	p.stats.reusedTokens.Add(int64(matched))
	b.reused = &turn
	return m, params
}

// prefilled: prefill answered with the KV's whereabouts; if it read the last turn's KV back,
// decode freed it.
func (p *plane) prefilled(b *bidiRequest) {
	if b.reused != nil {
		p.holds.released(b.reused.decodeURL, b.reused.requestID)
		p.turns.consumed(b.conversation, b.reused.requestID)
	}
}

// answered: decode's whole answer came (tokens_route.py keep_decode_kv). What it holds, for the
// budget: every finished choice; for the next turn, the conversation's, when decode said
// where (streamed turns say nothing, so they leave nothing to reuse, though decode holds them).
func (p *plane) answered(m *model, b *bidiRequest, answer []member, prompt []byte, promptTokens int) {
	elements, _ := arrayElements(lookup(answer, "choices"))
	choices := lookup(answer, "choices")
	var only []member
	for _, at := range elements {
		choice, err := topLevel(choices[at.start:at.end])
		if err != nil {
			continue
		}
		if heldFinishReasons[string(lookup(choice, "finish_reason"))] {
			b.held = append(b.held, promptTokens+int(tokensSent(choice)))
		}
		only = choice
	}
	params := lookup(answer, "kv_transfer_params")
	if b.conversation == "" || b.decodedOn == nil || len(elements) != 1 || len(params) == 0 || params[0] != '{' {
		return
	}
	fields, err := topLevel(params)
	if err != nil || !truthy(lookup(fields, "remote_request_id")) {
		return
	}
	tokens, ok := tokenIDs(prompt)
	output, outputOK := tokenIDs(lookup(only, "token_ids"))
	if lookup(only, "token_ids") == nil || string(lookup(only, "token_ids")) == "null" {
		output, outputOK = nil, true
	}
	if !ok || !outputOK {
		return
	}
	turn := heldTurn{params: append([]byte(nil), params...), tokens: append(tokens, output...),
		decodeURL: b.decodedOn.url, requestID: b.id}
	ttl := time.Duration(m.bidi.TTLSeconds * float64(time.Second))
	p.turns.keep(b.conversation, turn, ttl, m.bidi.MaxConversations)
}

// settle: the P/D request is over: what its decode engine holds now, if anything.
func (p *plane) settle(m *model, b *bidiRequest) {
	url, size := "", m.blockSize
	if b.pulled && b.decodedOn != nil {
		url = b.decodedOn.url
		if c := m.bidi.Capacity[b.decodedOn.key]; c.BlockSize > 0 {
			size = c.BlockSize
		}
	}
	p.holds.settle(b.id, url, b.held, size, m.bidi)
}

// narrowed: the model as one request may use it: each group's decode engines that pass
// keepDecode, and of those groups the ones keepGroup keeps (none left of its decode engines: gone).
func (m *model) narrowed(keepDecode func(*endpoint) bool, keepGroup func(*group) bool) *model {
	out := *m
	out.groups, out.prefills, out.decodes = nil, nil, nil
	for i := range m.groups {
		g := group{prefill: m.groups[i].prefill}
		for _, e := range m.groups[i].decode {
			if keepDecode(e) {
				g.decode = append(g.decode, e)
			}
		}
		if len(g.decode) == 0 || !keepGroup(&g) {
			continue
		}
		out.add(g)
	}
	return &out
}

// allowedPrefills: the model's prefill engines this request may use (in routing mode Auto,
// only those whose KV path fits: served.prefillOnly).
func allowedPrefills(m *model, s *served) []*endpoint {
	if len(s.prefillOnly) == 0 {
		return m.prefills
	}
	var out []*endpoint
	for _, e := range m.prefills {
		if slices.Contains(s.prefillOnly, e.url) {
			out = append(out, e)
		}
	}
	return out
}

// repick: the request's prefill and decode engines again, from a narrowed model.
func (m *model) repick(s *served) (prefill, decode *endpoint) {
	allowed := allowedPrefills(m, s)
	if len(allowed) == 0 {
		allowed = m.prefills
	}
	prefill = s.where.pick("prefill", allowed, true)
	return prefill, m.decodeFor(prefill, s.where)
}
