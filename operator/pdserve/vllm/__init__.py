"""vLLM's contract as pdserve speaks it: request and response bodies of the engines and render
servers, and the metric names they expose, with one way to read them."""
