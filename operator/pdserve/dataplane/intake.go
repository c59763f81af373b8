package main

// A completion the data plane cannot prove valid with its cheap checks (validate.go), or cannot
// read as the engines would (a Content-Encoding, a member given twice), is put to the Python
// gateway's intake (intake.py read_body and check_body, at intakePath + the completion's path):
// it answers with the body as it would send it on (decoded, each member once, the model and
// the max-tokens cap filled in), or with the client's answer (a 400 naming the parameter, a
// 404 for another model, a 415 for a coding it does not decode, ...). The data plane then
// serves that body, or gives that answer, itself: the Python gateway decides what is valid,
// the data plane carries the request (docs/architecture.md).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
)

// intakePath is gateway/dataplane.py INTAKE_PATH; the intake's answers (whatever their status)
// carry intakeHeader (INTAKE_HEADER).
const (
	intakePath   = "/_pdserve/dataplane/intake"
	intakeHeader = "X-PDServe-Intake"
)

type intakeClient struct {
	base   string // the Python gateway's URL
	token  string
	client *http.Client
	limit  int64 // the largest answer read: a decoded body is at most -max-body-bytes
}

// verdict is the intake's answer: the body to serve (status 200), or the client's answer.
type verdict struct {
	status int
	body   []byte
}

// Headers the intake reads: how the body is encoded and in which charset, and the client's
// credentials (its key check runs on every path but the probes).
var intakeHeaders = []string{"Content-Type", "Content-Encoding", "Authorization"}

func (c *intakeClient) check(ctx context.Context, r *http.Request, body []byte) (verdict, error) {
	request, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+intakePath+r.URL.Path,
		bytes.NewReader(body))
	if err != nil {
		return verdict{}, err
	}
	for _, name := range intakeHeaders {
		if values := r.Header.Values(name); len(values) > 0 {
			request.Header[name] = values
		}
	}
	request.Header.Set(tokenHeader, c.token)
	response, err := c.client.Do(request)
	if err != nil {
		return verdict{}, err
	}
	defer response.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(response.Body, c.limit+1))
	switch {
	case err != nil:
		return verdict{}, err
	case int64(len(answer)) > c.limit:
		return verdict{}, fmt.Errorf("the intake's answer is over %d bytes", c.limit)
	case response.Header.Get(intakeHeader) == "":
		return verdict{}, errors.New("the Python gateway did not answer as its intake (" + response.Status + ")")
	}
	return verdict{status: response.StatusCode, body: answer}, nil
}

// answerVerdict gives the client the intake's answer, counted as the Python gateway counts a
// request refused before any engine call (route unknown).
func answerVerdict(w http.ResponseWriter, s *served, v verdict) {
	s.route = "unknown"
	s.outcome = "error_" + strconv.Itoa(v.status)
	header := w.Header()
	header.Set("Content-Type", "application/json")
	header.Set("Content-Length", strconv.Itoa(len(v.body)))
	if v.status == http.StatusTooManyRequests || v.status == http.StatusServiceUnavailable {
		header.Set("Retry-After", "1")
	}
	w.WriteHeader(v.status)
	_, _ = w.Write(v.body)
}
