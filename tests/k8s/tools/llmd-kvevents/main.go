// The llm-d side of tests/integration/test_kv_events_llmd.py: llm-d-kv-cache's own ZMQ
// subscriber, vLLM adapter, event pool and in-memory index, fed by a batchpilot engine's
// KV events, as llm-d's precise prefix-cache scorer is. It binds -endpoint (llm-d's
// central-subscriber mode), prints "ready", then answers one query per stdin line:
// {"model": "...", "tokens": [...]} -> {"pods": [[pod@tier, ...] for each block key]}.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"

	"github.com/go-logr/logr/funcr"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
)

type query struct {
	Model  string   `json:"model"`
	Tokens []uint32 `json:"tokens"`
}

func main() {
	endpoint := flag.String("endpoint", "", "ZMQ endpoint to bind")
	blockSize := flag.Int("block-size", 16, "tokens per block, as the engine's")
	verbosity := flag.Int("v", 0, "log verbosity on stderr (llm-d's debug level is 4, trace 5)")
	flag.Parse()
	logger := funcr.New(func(prefix, args string) { fmt.Fprintln(os.Stderr, prefix, args) },
		funcr.Options{Verbosity: *verbosity})
	ctx := log.IntoContext(context.Background(), logger)

	index, err := kvblock.NewInMemoryIndex(kvblock.DefaultInMemoryIndexConfig())
	exitOn(err)
	tokens, err := kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{BlockSizeTokens: *blockSize})
	exitOn(err)
	cfg := kvevents.DefaultConfig()
	cfg.DiscoverPods = false
	pool := kvevents.NewPool(cfg, index, tokens, engineadapter.NewVLLMAdapter())
	pool.Start(ctx)
	subscribers := kvevents.NewSubscriberManager(pool)
	exitOn(subscribers.EnsureSubscriber(ctx, "central", *endpoint, cfg.TopicFilter, false))
	fmt.Println("ready")

	lines := bufio.NewScanner(os.Stdin)
	lines.Buffer(make([]byte, 1<<20), 1<<24)
	out := json.NewEncoder(os.Stdout)
	for lines.Scan() {
		var q query
		exitOn(json.Unmarshal(lines.Bytes(), &q))
		keys, err := tokens.TokensToKVBlockKeys(kvblock.EmptyBlockHash, q.Tokens, q.Model, nil)
		exitOn(err)
		pods := make([][]string, len(keys))
		if len(keys) > 0 {
			found, err := index.Lookup(ctx, keys, nil)
			exitOn(err)
			for i, key := range keys {
				for _, entry := range found[key] {
					pods[i] = append(pods[i], entry.String())
				}
			}
		}
		exitOn(out.Encode(map[string]any{"pods": pods}))
	}
}

func exitOn(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "llmd-kvevents:", err)
		os.Exit(1)
	}
}
