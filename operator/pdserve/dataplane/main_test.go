package main

import (
	"errors"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestAPythonGatewayThatIsNotListeningIsA503TheClientMayRetry(t *testing.T) {
	recorder := httptest.NewRecorder()
	pythonUnavailable(recorder, nil, errors.New("connection refused"))
	if recorder.Code != 503 || recorder.Header().Get("Retry-After") != "1" ||
		!strings.Contains(recorder.Body.String(), `"code":503`) {
		t.Fatalf("%d %v %s", recorder.Code, recorder.Header(), recorder.Body.String())
	}
}
