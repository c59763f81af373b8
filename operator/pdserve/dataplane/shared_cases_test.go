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

// sharedError: an error as shared cases state it (the Python gateway's GatewayError).
type sharedError struct {
	Status  int     `json:"status"`
	Type    string  `json:"type"`
	Message string  `json:"message"`
	Param   *string `json:"param"`
}

// failure: the error as the data plane holds it ("param": null is "").
func (e sharedError) failure() *failure {
	f := &failure{status: e.Status, kind: e.Type, message: e.Message, final: true}
	if e.Param != nil {
		f.param = *e.Param
	}
	return f
}
