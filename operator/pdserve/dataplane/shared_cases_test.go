package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// sharedCases reads testdata/<name>, cases the Python gateway's tests read too: one fact, two
// implementations, held to the same answers.
func sharedCases[T any](t testing.TB, name string) T {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	var cases T
	if err := json.Unmarshal(raw, &cases); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return cases
}
