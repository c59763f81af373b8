// The gateway-overhead benchmark's native helpers (pdserve bench overhead): a stub OpenAI
// engine that answers in microseconds and a load generator, so neither is the bottleneck
// when proxies are compared. Standard library only: nothing to download.
module pdserve.io/bench/native

go 1.22
