package main

import (
	"encoding/json"
	"math"
	"slices"
	"strings"
	"testing"
)

// placementCases is testdata/placement_cases.json, which the Python gateway's tests read too
// (tests/unit/gateway/test_placement_cases.py).
type placementCases struct {
	Placement placementJSON `json:"placement"`
	Pick      []struct {
		Name    string `json:"name"`
		Engines []struct {
			Key  string  `json:"key"`
			Load float64 `json:"load"`
		} `json:"engines"`
		CachedBlocks       map[string]int `json:"cachedBlocks"`
		ConversationEngine *string        `json:"conversationEngine"`
		Pick               string         `json:"pick"`
		Rank               []string       `json:"rank"`
	} `json:"pick"`
	Conversation []struct {
		Name           string  `json:"name"`
		ConversationID any     `json:"conversationId"`
		Header         *string `json:"header"`
		Want           *string `json:"conversation"`
	} `json:"conversation"`
	Load []struct {
		Name     string  `json:"name"`
		Base     float64 `json:"base"`
		Inflight int64   `json:"inflight"`
		Backlog  int64   `json:"backlog"`
		Load     float64 `json:"load"`
	} `json:"load"`
	Prefix []struct {
		Name         string    `json:"name"`
		BlockSize    int       `json:"blockSize"`
		MaxBlocks    int       `json:"maxBlocks"`
		Sent         [][]int64 `json:"sent"`
		Prompt       []int64   `json:"prompt"`
		CachedBlocks int       `json:"cachedBlocks"`
	} `json:"prefix"`
}

func TestAnEngineIsPickedAsTheSharedCaseSays(t *testing.T) {
	cases := sharedCases[placementCases](t, "placement_cases.json")
	for _, c := range cases.Pick {
		t.Run(c.Name, func(t *testing.T) {
			var pool []*endpoint
			for _, each := range c.Engines {
				e := &endpoint{url: each.Key, key: each.Key}
				e.base.Store(math.Float64bits(each.Load))
				pool = append(pool, e)
				if blocks := c.CachedBlocks[each.Key]; blocks > 0 {
					hashes := make([]uint64, blocks)
					for i := range hashes {
						hashes[i] = uint64(i + 1)
					}
					e.prefixes.record(hashes, cases.Placement.MaxBlocks)
				}
			}
			w := &placing{rule: cases.Placement, known: &conversations{}, hashes: []uint64{}}
			for i := 1; i <= 1000; i++ {
				w.hashes = append(w.hashes, uint64(i))
			}
			if c.ConversationEngine != nil {
				w.conversation = "c-1"
				w.known.remember("c-1", "decode", *c.ConversationEngine, cases.Placement.MaxConversations)
			}
			if got := w.pick("decode", pool, true); got.key != c.Pick {
				t.Errorf("picked %s, want %s", got.key, c.Pick)
			}
			var order []string
			for _, e := range w.rank("decode", pool, true) {
				order = append(order, e.key)
			}
			if !slices.Equal(order, c.Rank) {
				t.Errorf("ranked %v, want %v", order, c.Rank)
			}
		})
	}
}

// An engine's load as the table sets it (the pushed view, the rule's tokens per unit), with
// this data plane's own requests in flight and prompt tokens owed.
func TestAnEngineWeighsAsTheSharedCaseSays(t *testing.T) {
	cases := sharedCases[placementCases](t, "placement_cases.json")
	for _, c := range cases.Load {
		t.Run(c.Name, func(t *testing.T) {
			in, _ := json.Marshal(tableJSON{Version: 1, Placement: &cases.Placement,
				Load:   map[string]float64{"http://a:8000": c.Base},
				Models: map[string]modelJSON{"m": {Route: routeDecode, Groups: []groupJSON{{Decode: []string{"http://a:8000"}}}}}})
			built, _, err := build(in, nil)
			if err != nil {
				t.Fatal(err)
			}
			e := built.models["m"].decodes[0]
			e.inflight.Add(c.Inflight)
			prefilled := e.owe(c.Backlog)
			if got := e.load(); math.Abs(got-c.Load) > 1e-9 {
				t.Errorf("load %v, want %v", got, c.Load)
			}
			prefilled()
			prefilled() // owed once, given back once
			if got, want := e.load(), c.Base+float64(c.Inflight); math.Abs(got-want) > 1e-9 {
				t.Errorf("once prefilled: load %v, want %v", got, want)
			}
		})
	}
}

func TestCachedBlocksAreCountedAsTheSharedCaseSays(t *testing.T) {
	for _, c := range sharedCases[placementCases](t, "placement_cases.json").Prefix {
		t.Run(c.Name, func(t *testing.T) {
			hashesOf := func(tokens []int64) []uint64 {
				raw, _ := json.Marshal(tokens)
				hashes, ok := blockHashes(raw, c.BlockSize)
				if !ok {
					t.Fatalf("%s: not read as token ids", raw)
				}
				return hashes
			}
			var cache prefixCache
			for _, sent := range c.Sent {
				cache.record(hashesOf(sent), c.MaxBlocks)
			}
			if got := cache.cachedBlocks(hashesOf(c.Prompt)); got != c.CachedBlocks {
				t.Errorf("%d blocks cached, want %d", got, c.CachedBlocks)
			}
			if cache.blocks.len() > c.MaxBlocks {
				t.Errorf("%d blocks kept, over the bound %d", cache.blocks.len(), c.MaxBlocks)
			}
		})
	}
}

func TestTokenIdsAreReadAsRenderWritesThemOrNotAtAll(t *testing.T) {
	compact, _ := blockHashes([]byte(`[1,2,3,4,5]`), 2)
	spaced, ok := blockHashes([]byte("[ 1, 2 ,\n3,4 , 5 ]"), 2)
	if !ok || !slices.Equal(compact, spaced) || len(compact) != 2 {
		t.Errorf("spacing changed the hashes: %v vs %v (ok %v)", compact, spaced, ok)
	}
	if hashes, ok := blockHashes([]byte(`[]`), 2); !ok || len(hashes) != 0 {
		t.Errorf("[]: %v %v", hashes, ok)
	}
	if hashes, ok := blockHashes([]byte("[ \n]"), 1); !ok || len(hashes) != 0 {
		t.Errorf("[ \\n]: %v %v", hashes, ok)
	}
	long := make([]int64, 100) // past the eight-byte reads: the same ids, any spacing, any block
	for i := range long {
		long[i] = int64(i*7919) % 151_936
	}
	raw, _ := json.Marshal(long)
	spacedLong := strings.ReplaceAll(string(raw), ",", ", ")
	for _, size := range []int{1, 3, 16, 100, 101} {
		a, _ := blockHashes(raw, size)
		b, ok := blockHashes([]byte(spacedLong), size)
		if !ok || !slices.Equal(a, b) || len(a) != 100/size {
			t.Errorf("block size %d: %d hashes, spaced %d (ok %v)", size, len(a), len(b), ok)
		}
	}
	// Characters no array of integers holds; a malformed one of digits and commas ([1,,2])
	// is hashed as written: the engine refuses it, placement only needs equal ids to match.
	for _, bad := range []string{`[1.5,2]`, `["1"]`, `[1,2`, `1,2]`, `[1,2]x`, `[[1]]`, `[1e3]`, `[`, ``} {
		if _, ok := blockHashes([]byte(bad), 1); ok {
			t.Errorf("%q read as token ids", bad)
		}
	}
	if _, ok := blockHashes([]byte(`[1,2]`), 0); ok {
		t.Error("a block size of 0 hashed")
	}
}

func TestAConversationIsNamedAsTheSharedCaseSays(t *testing.T) {
	for _, c := range sharedCases[placementCases](t, "placement_cases.json").Conversation {
		raw := []byte{}
		if c.ConversationID != nil {
			raw, _ = json.Marshal(c.ConversationID)
		}
		header, want := "", ""
		if c.Header != nil {
			header = *c.Header
		}
		if c.Want != nil {
			want = *c.Want
		}
		if got := conversationOf(raw, header); got != want {
			t.Errorf("%s: %q, want %q", c.Name, got, want)
		}
	}
	// JSON escapes are the data plane's own reading: the Python gateway gets the string decoded.
	if got := conversationOf([]byte(`"c\u002d7"`), ""); got != "c-7" {
		t.Errorf("an escaped id: %q", got)
	}
}

func TestTheLeastRecentlyUsedIsForgottenFirstAndALowerBoundApplies(t *testing.T) {
	l := newLRU[string, int]()
	for i, key := range []string{"a", "b", "c"} {
		l.put(key, i, 3)
	}
	l.put("a", 10, 3) // used again: "b" is now the oldest
	l.put("d", 3, 3)
	if l.has("b") || !l.has("a") || !l.has("c") || !l.has("d") {
		t.Errorf("kept %v", l.index)
	}
	if v, _ := l.get("a"); v != 10 {
		t.Errorf("a = %d", v)
	}
	l.put("e", 4, 2) // a table with a lower bound: down to it
	if l.len() != 2 || !l.has("e") || !l.has("d") {
		t.Errorf("kept %v", l.index)
	}
	l.put("f", 5, 0)
	if l.has("f") {
		t.Error("a bound of 0 kept a key")
	}
}

func TestARequestWithNothingToGoByIsPlacedByLoadWithoutAllocating(t *testing.T) {
	a, b := &endpoint{url: "http://a", key: "http://a"}, &endpoint{url: "http://b", key: "http://b"}
	a.inflight.Add(1)
	pool := []*endpoint{a, b}
	var w *placing
	if allocs := testing.AllocsPerRun(100, func() {
		if w.pick("decode", pool, true) != b {
			t.Fatal("not the least loaded")
		}
	}); allocs != 0 {
		t.Errorf("%v allocations per pick", allocs)
	}
}

// Whatever render sends as token ids is read without panicking, and read as token ids exactly
// when it is a JSON array of integers in int64's range, each full block of them hashed.
func FuzzTokenIdsFromRenderAreReadSafely(f *testing.F) {
	for _, seed := range []string{`[1,2,3,4,5]`, `[ -1 , 9223372036854775807 ]`, `[]`, `[1,]`,
		`[1.0]`, `["a"]`, `[[1]]`, `[1 2]`, `{}`, ``} {
		f.Add([]byte(seed), 2)
	}
	f.Fuzz(func(t *testing.T, tokens []byte, blockSize int) {
		if blockSize < 1 || blockSize > 64 {
			return
		}
		hashes, ok := blockHashes(tokens, blockSize)
		var ids []int64
		strict := json.Unmarshal(tokens, &ids) == nil && tokens[0] == '[' && tokens[len(tokens)-1] == ']'
		for _, b := range tokens {
			if b == '.' || b == 'e' || b == 'E' || b == '+' || b == 'n' {
				strict = false // 1.0, 1e3, null: JSON's reader takes them, render never sends them
			}
		}
		if strict && (!ok || len(hashes) != len(ids)/blockSize) {
			t.Fatalf("%q: ok %v, %d hashes for %d ids", tokens, ok, len(hashes), len(ids))
		}
		if ok && !strict && json.Valid(tokens) {
			var any []json.Number
			if json.Unmarshal(tokens, &any) != nil {
				t.Fatalf("%q read as token ids, yet not an array of numbers", tokens)
			}
		}
	})
}

// The render route's cost of placement per request: a 2,000-token prompt's block hashes.
func BenchmarkBlockHashesOfA2000TokenPrompt(b *testing.B) {
	ids := make([]int64, 2000)
	for i := range ids {
		ids[i] = int64(i*7919) % 151_936
	}
	raw, _ := json.Marshal(ids)
	b.SetBytes(int64(len(raw)))
	b.ResetTimer()
	for range b.N {
		if _, ok := blockHashes(raw, 16); !ok {
			b.Fatal("not read")
		}
	}
}
