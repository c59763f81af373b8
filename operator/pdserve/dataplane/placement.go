package main

// Which engine a request's hops prefer (the Python gateway's placement.py and Endpoints.pick):
// the one that probably holds its KV already, where its prompt's leading blocks were sent
// before or where its conversation ran last, unless that one is much busier than the least
// loaded. The rule and its numbers come with the routing table; the shared cases
// (testdata/placement_cases.json) hold both sides to the same picks.
//
// Each process keeps its own index of what it sent, so the block hashes need not match the
// Python gateway's (blake2b there): here a chained hash/maphash, seeded per process.

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/maphash"
	"math"
	"math/bits"
	"sort"
	"sync"
)

// placementJSON: the rule's numbers, as the Python gateway pushes them (fastpath.PLACEMENT).
type placementJSON struct {
	Slack             float64 `json:"affinitySlack"`
	ConversationBonus int     `json:"conversationBonus"`
	MaxBlocks         int     `json:"maxBlocksPerEngine"`
	MaxConversations  int     `json:"maxConversations"`
	// One unit of an engine's load per this many prompt tokens sent to it and not prefilled
	// yet (endpoints.PREFILL_TOKENS_PER_LOAD_UNIT); 0: that backlog is not weighed.
	TokensPerLoadUnit float64 `json:"prefillTokensPerLoadUnit"`
}

// validPlacement: absent (an older gateway) picks by load alone; present, every number sane.
func validPlacement(p *placementJSON) error {
	if p == nil {
		return nil
	}
	finite := func(x float64) bool { return x >= 0 && !math.IsInf(x, 0) }
	if !finite(p.Slack) || !finite(p.TokensPerLoadUnit) || p.ConversationBonus < 0 ||
		p.MaxBlocks < 0 || p.MaxConversations < 0 {
		return fmt.Errorf("routing table: placement: affinitySlack, conversationBonus, maxBlocksPerEngine, maxConversations and prefillTokensPerLoadUnit must be finite and not negative")
	}
	return nil
}

// lru is a bounded map that forgets the least recently used key first (the Python gateway's
// OrderedDict with move_to_end); its nodes live in one slice, linked by index.
type lru[K comparable, V any] struct {
	index      map[K]int32
	nodes      []lruNode[K, V]
	head, tail int32 // most and least recently used; -1 when empty
}

type lruNode[K comparable, V any] struct {
	key        K
	value      V
	prev, next int32
}

func newLRU[K comparable, V any]() *lru[K, V] {
	return &lru[K, V]{index: map[K]int32{}, head: -1, tail: -1}
}

func (l *lru[K, V]) unlink(i int32) {
	n := &l.nodes[i]
	if n.prev >= 0 {
		l.nodes[n.prev].next = n.next
	} else {
		l.head = n.next
	}
	if n.next >= 0 {
		l.nodes[n.next].prev = n.prev
	} else {
		l.tail = n.prev
	}
}

func (l *lru[K, V]) pushFront(i int32) {
	n := &l.nodes[i]
	n.prev, n.next = -1, l.head
	if l.head >= 0 {
		l.nodes[l.head].prev = i
	}
	l.head = i
	if l.tail < 0 {
		l.tail = i
	}
}

// put stores key's value as the most recently used; past `limit` keys the oldest goes (its
// node reused, so the slice never outgrows the limit).
func (l *lru[K, V]) put(key K, value V, limit int) {
	if limit <= 0 {
		return
	}
	if i, ok := l.index[key]; ok {
		l.nodes[i].value = value
		l.unlink(i)
		l.pushFront(i)
		return
	}
	var i int32
	if len(l.index) >= limit {
		i = l.tail
		l.unlink(i)
		delete(l.index, l.nodes[i].key)
		for len(l.index) >= limit { // a lower limit pushed since: forget down to it
			j := l.tail
			l.unlink(j)
			delete(l.index, l.nodes[j].key)
		}
	} else {
		l.nodes = append(l.nodes, lruNode[K, V]{})
		i = int32(len(l.nodes) - 1)
	}
	l.nodes[i].key, l.nodes[i].value = key, value
	l.index[key] = i
	l.pushFront(i)
}

func (l *lru[K, V]) get(key K) (V, bool) {
	i, ok := l.index[key]
	if !ok {
		var zero V
		return zero, false
	}
	return l.nodes[i].value, true
}

// set changes a key's value where it stands (not made the most recently used); an absent key
// stays absent.
func (l *lru[K, V]) set(key K, value V) {
	if i, ok := l.index[key]; ok {
		l.nodes[i].value = value
	}
}

func (l *lru[K, V]) has(key K) bool {
	_, ok := l.index[key]
	return ok
}

func (l *lru[K, V]) len() int { return len(l.index) }

// prefixCache: the block hashes one engine (or rank) was sent lately.
type prefixCache struct {
	mu     sync.Mutex
	blocks *lru[uint64, struct{}]
}

// cachedBlocks: how many leading blocks of a prompt the engine probably has cached.
func (c *prefixCache) cachedBlocks(hashes []uint64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.blocks == nil {
		return 0
	}
	count := 0
	for _, h := range hashes {
		if !c.blocks.has(h) {
			break
		}
		count++
	}
	return count
}

func (c *prefixCache) record(hashes []uint64, limit int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.blocks == nil {
		c.blocks = newLRU[uint64, struct{}]()
	}
	for _, h := range hashes {
		c.blocks.put(h, struct{}{}, limit)
	}
}

var blockSeed = maphash.MakeSeed()

// blockHashes: chained hashes of a prompt's full blocks of token ids (a JSON array of
// integers, as render answers), each over the previous one and the block's ids as render
// wrote them (whitespace left out), so two prompts share a hash exactly as far as they share
// whole leading blocks. ok is false when it is not an array of integers' characters (digits,
// minus signs, commas, whitespace): render sends nothing else, and an engine refuses what is
// malformed among them; placement only needs the same ids to hash the same. It runs on every
// rendered request over its whole prompt, so it reads eight bytes at a time.
func blockHashes(tokens []byte, blockSize int) (hashes []uint64, ok bool) {
	if blockSize <= 0 || len(tokens) < 2 || tokens[0] != '[' || tokens[len(tokens)-1] != ']' {
		return nil, false
	}
	text := tokens[1 : len(tokens)-1]
	if len(text) == 0 {
		return nil, true
	}
	var chained uint64
	start, commas := 0, 0 // where the block began; the commas since, its ids before the last
	block := func(end int) {
		chained = mixed(chained*0x9E3779B97F4A7C15 + maphash.Bytes(blockSeed, text[start:end]))
		hashes = append(hashes, chained)
		start, commas = end+1, 0
	}
	i := 0
	for ; i+8 <= len(text); i += 8 {
		x := binary.LittleEndian.Uint64(text[i:])
		if !idsOnly(x) {
			break // whitespace, or not ids: read byte by byte from here
		}
		found := zeroBytes(x ^ (',' * ones))
		if n := bits.OnesCount64(found); commas+n < blockSize {
			commas += n
			continue
		}
		for ; found != 0; found &= found - 1 {
			if commas++; commas == blockSize {
				block(i + bits.TrailingZeros64(found)/8)
			}
		}
	}
	if i < len(text) {
		rest, ok := idsText(text[i:])
		if !ok {
			return nil, false
		}
		if len(rest) < len(text)-i { // whitespace left out: the rest hashed from a copy
			text = append(append(make([]byte, 0, i+len(rest)), text[:i]...), rest...)
		}
		if len(text) == 0 {
			return nil, true
		}
		for ; i < len(text); i++ {
			if text[i] == ',' {
				if commas++; commas == blockSize {
					block(i)
				}
			}
		}
	}
	if commas+1 == blockSize { // the last id completes a block
		block(len(text))
	}
	return hashes, true
}

// idsText: a token id array's contents without whitespace (the same bytes when it has none,
// as render writes them); false when a byte is none of an integer array's.
func idsText(inner []byte) ([]byte, bool) {
	spaced := false
	for i := 0; i < len(inner); i += 8 {
		if i+8 <= len(inner) && idsOnly(binary.LittleEndian.Uint64(inner[i:])) {
			continue
		}
		for _, c := range inner[i:min(i+8, len(inner))] {
			switch {
			case jsonSpace(c):
				spaced = true
			case c != ',' && c != '-' && (c < '0' || c > '9'):
				return nil, false
			}
		}
	}
	if !spaced {
		return inner, true
	}
	compact := make([]byte, 0, len(inner))
	for _, c := range inner {
		if !jsonSpace(c) {
			compact = append(compact, c)
		}
	}
	return compact, true
}

// idsOnly: whether all eight bytes of x are digits, commas or minus signs (',' '-' '0'-'9'
// are 0x2c-0x39 but for '.' and '/').
func idsOnly(x uint64) bool {
	if x&highs != 0 {
		return false
	}
	atLeastComma := (x + (0x80-',')*ones) & highs
	aboveNine := (x + (0x7f-'9')*ones) & highs
	dotOrSlash := zeroBytes((x &^ (1 * ones)) ^ ('.' * ones))
	return atLeastComma == highs && aboveNine == 0 && dotOrSlash == 0
}

// mixed is murmur3's 64-bit finalizer: every bit of x moves about half of the result's.
func mixed(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	return x ^ x>>33
}

// conversationKey: one conversation's engine per stage.
type conversationKey struct{ conversation, stage string }

// conversations: conversation id -> the engine (key) per stage it used last (LRU, bounded).
type conversations struct {
	mu   sync.Mutex
	last *lru[conversationKey, string]
}

func (c *conversations) engine(conversation, stage string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last == nil {
		return ""
	}
	key, _ := c.last.get(conversationKey{conversation, stage})
	return key
}

func (c *conversations) remember(conversation, stage, key string, limit int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last == nil {
		c.last = newLRU[conversationKey, string]()
	}
	c.last.put(conversationKey{conversation, stage}, key, limit)
}

// placing: what one request's engines are picked by (nil: load alone).
type placing struct {
	rule         placementJSON
	known        *conversations
	conversation string   // "" when the request names none
	hashes       []uint64 // its prompt's block hashes; nil without token ids
}

// scores: per engine key, how much of the request's KV it probably holds (affinity.scores):
// the prompt's leading blocks it cached (with `prefix`; decode given prefill's KV pulls it,
// its own cache does not matter) and the bonus for the conversation's last engine of `stage`.
func (w *placing) scores(stage string, pool []*endpoint, prefix bool) map[string]int {
	if w == nil {
		return nil
	}
	var out map[string]int
	if prefix && len(w.hashes) > 0 {
		for _, e := range pool {
			if blocks := e.prefixes.cachedBlocks(w.hashes); blocks > 0 {
				if out == nil {
					out = map[string]int{}
				}
				out[e.key] = blocks
			}
		}
	}
	if w.conversation != "" {
		if key := w.known.engine(w.conversation, stage); key != "" {
			if out == nil {
				out = map[string]int{}
			}
			out[key] += w.rule.ConversationBonus
		}
	}
	return out
}

// remember: `stage` ran on e; with `prefix`, e prefilled the prompt itself.
func (w *placing) remember(stage string, e *endpoint, prefix bool) {
	if w == nil || e == nil {
		return
	}
	if prefix && len(w.hashes) > 0 {
		e.prefixes.record(w.hashes, w.rule.MaxBlocks)
	}
	if w.conversation != "" {
		w.known.remember(w.conversation, stage, e.key, w.rule.MaxConversations)
	}
}

// best is Endpoints._best: the least loaded engine, unless one holding some of the request's
// KV is at most `slack` busier than it: then the one holding the most (the less loaded of
// equals, the first of equal ones).
func best(pool []*endpoint, affinity map[string]int, slack float64) *endpoint {
	if len(pool) == 0 {
		return nil
	}
	leastLoaded := least(pool)
	if len(affinity) == 0 {
		return leastLoaded
	}
	bound := leastLoaded.load() + slack
	var warm *endpoint
	warmScore, warmLoad := 0, 0.0
	for _, e := range pool {
		score := affinity[e.key]
		if score <= 0 {
			continue
		}
		load := e.load()
		if load > bound {
			continue
		}
		if warm == nil || score > warmScore || (score == warmScore && load < warmLoad) {
			warm, warmScore, warmLoad = e, score, load
		}
	}
	if warm != nil {
		return warm
	}
	return leastLoaded
}

// ranked is Endpoints.rank: every engine of pool, in the order best would pick them.
func ranked(pool []*endpoint, affinity map[string]int, slack float64) []*endpoint {
	out := make([]*endpoint, 0, len(pool))
	if len(affinity) == 0 {
		out = append(out, pool...)
		sort.SliceStable(out, func(a, b int) bool { return out[a].load() < out[b].load() })
		return out
	}
	remaining := append([]*endpoint(nil), pool...)
	for len(remaining) > 0 {
		chosen := best(remaining, affinity, slack)
		out = append(out, chosen)
		for i, e := range remaining {
			if e == chosen {
				remaining = append(remaining[:i], remaining[i+1:]...)
				break
			}
		}
	}
	return out
}

// pick: the best engine of pool for this request's `stage`.
func (w *placing) pick(stage string, pool []*endpoint, prefix bool) *endpoint {
	if w == nil || len(pool) < 2 { // one engine: nothing to score (a long prompt's thousands of blocks)
		return least(pool)
	}
	return best(pool, w.scores(stage, pool, prefix), w.rule.Slack)
}

// rank: pool in the order pick would choose them.
func (w *placing) rank(stage string, pool []*endpoint, prefix bool) []*endpoint {
	if w == nil || len(pool) < 2 {
		return ranked(pool, nil, 0)
	}
	return ranked(pool, w.scores(stage, pool, prefix), w.rule.Slack)
}

// placing: what this request's engines are picked by beside load, nil when nothing: no rule
// pushed, or neither a conversation nor token ids to go by.
func (p *plane) placing(t *table, m *model, members []member, header string) *placing {
	if t.placement == nil {
		return nil
	}
	conversation := conversationOf(lookup(members, "conversation_id"), header)
	if conversation == "" && len(m.render) == 0 {
		return nil
	}
	return &placing{rule: *t.placement, known: &p.conversations, conversation: conversation}
}

// conversationOf: the request's conversation as exchange.conversation reads it: the body's
// conversation_id (a string or an integer, already validated) unless it is empty or 0, then
// the X-Conversation-Id header.
func conversationOf(raw []byte, header string) string {
	switch text := string(raw); text {
	case "", "null", `""`, "0", "-0":
		return header
	}
	if raw[0] != '"' {
		return string(raw) // an integer, as str() writes it (JSON allows no leading zeros)
	}
	if plainString(raw) {
		return string(raw[1 : len(raw)-1])
	}
	var id string
	if json.Unmarshal(raw, &id) != nil || id == "" {
		return header
	}
	return id
}
