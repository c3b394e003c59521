// pickclient asks a Gateway API Inference Extension endpoint picker (EPP) for picks the way
// Envoy's ext_proc filter does in FULL_DUPLEX_STREAMED request-body mode (the mode GIE's
// gateways configure): one bidirectional Process stream per request, the request headers
// (no end_of_stream), then the JSON body with end_of_stream. The EPP buffers the body, runs
// its scheduler and only then answers: first a request-headers response whose header
// mutation sets x-gateway-destination-endpoint (also in dynamic metadata under
// envoy.lb/x-gateway-destination-endpoint), then the (possibly rewritten) body as streamed
// body responses. An error becomes an ImmediateResponse (an HTTP status and a message).
//
// One JSON line per pick on stdout: {"endpoint": "10.244.0.7:8000"} or {"error": "..."}.
// The exit status is 1 when any pick failed.
//
// With --listen it is a minimal gateway instead (gateway.go): an HTTP server that asks the
// EPP for each request it receives, with the request's own path, headers and body, then
// forwards the request to the picked endpoint and streams the answer back.
package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// destinationHeader is GIE's metadata.DestinationEndpointKey (pkg/epp/metadata/consts.go).
const destinationHeader = "x-gateway-destination-endpoint"

type headerFlags []string

func (h *headerFlags) String() string     { return strings.Join(*h, ",") }
func (h *headerFlags) Set(v string) error { *h = append(*h, v); return nil }

type options struct {
	addr, model, prompt, authority, path, listen string
	count, maxTokens                             int
	timeout                                      time.Duration
	tls                                          bool
	headers                                      headerFlags
}

func parseFlags() options {
	var o options
	flag.StringVar(&o.addr, "addr", "localhost:9002", "the EPP's ext_proc gRPC address (host:port, plaintext)")
	flag.StringVar(&o.model, "model", "", "the request's model (required)")
	flag.StringVar(&o.prompt, "prompt", "Hello", "the request's prompt")
	flag.IntVar(&o.count, "count", 1, "number of picks (one Process stream each)")
	flag.IntVar(&o.maxTokens, "max-tokens", 16, "the request's max_tokens")
	flag.StringVar(&o.path, "path", "/v1/completions", "the request's :path")
	flag.StringVar(&o.authority, "authority", "gateway.local", "the request's :authority")
	flag.DurationVar(&o.timeout, "timeout", 10*time.Second, "per-pick timeout")
	flag.Var(&o.headers, "header", "extra request header k=v (repeatable)")
	flag.BoolVar(&o.tls, "tls", false, "speak TLS to the EPP without verifying its certificate (the EPP's default --secure-serving uses a self-signed one, which gateways accept)")
	flag.StringVar(&o.listen, "listen", "", "serve as a gateway on this address (e.g. :8080) instead of printing picks")
	flag.Parse()
	if o.listen != "" {
		return o
	}
	if o.model == "" || o.count < 1 {
		fmt.Fprintln(os.Stderr, "pickclient: --model is required and --count must be >= 1")
		flag.Usage()
		os.Exit(2)
	}
	return o
}

func header(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, RawValue: []byte(v)} }

func requestMessages(o options) ([]*extprocv3.ProcessingRequest, error) {
	body, err := json.Marshal(map[string]any{"model": o.model, "prompt": o.prompt, "max_tokens": o.maxTokens})
	if err != nil {
		return nil, err
	}
	return bodyMessages(o, o.path, body)
}

// bodyMessages: the request headers (":path" path, o's authority and extra headers), then
// body with end_of_stream, as Envoy sends them in FULL_DUPLEX_STREAMED mode.
func bodyMessages(o options, path string, body []byte) ([]*extprocv3.ProcessingRequest, error) {
	hs := []*corev3.HeaderValue{
		header(":method", "POST"), header(":path", path), header(":scheme", "http"),
		header(":authority", o.authority), header("content-type", "application/json"),
	}
	for _, kv := range o.headers {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--header %q: want k=v", kv)
		}
		hs = append(hs, header(strings.ToLower(k), v))
	}
	hs = append(hs, header("content-length", fmt.Sprint(len(body))))
	return []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: hs}, EndOfStream: false}}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: body, EndOfStream: true}}},
	}, nil
}

// endpointOf returns the picked endpoint of a request-headers response, or "".
func endpointOf(r *extprocv3.HeadersResponse) string {
	for _, h := range r.GetResponse().GetHeaderMutation().GetSetHeaders() {
		if strings.EqualFold(h.GetHeader().GetKey(), destinationHeader) {
			if v := h.GetHeader().GetRawValue(); len(v) > 0 {
				return string(v)
			}
			return h.GetHeader().GetValue()
		}
	}
	return ""
}

func pick(ctx context.Context, client extprocv3.ExternalProcessorClient, o options) (string, error) {
	msgs, err := requestMessages(o)
	if err != nil {
		return "", err
	}
	return pickFor(ctx, client, o, msgs)
}

// pickFor sends msgs on one Process stream and returns the endpoint the EPP picked.
func pickFor(ctx context.Context, client extprocv3.ExternalProcessorClient, o options,
	msgs []*extprocv3.ProcessingRequest) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	stream, err := client.Process(ctx)
	if err != nil {
		return "", fmt.Errorf("open stream: %w", err)
	}
	for _, m := range msgs {
		if err := stream.Send(m); err != nil {
			return "", fmt.Errorf("send: %w", err)
		}
	}
	for {
		resp, err := stream.Recv()
		if err == io.EOF {
			return "", fmt.Errorf("stream closed by the EPP without a pick")
		}
		if err != nil {
			return "", fmt.Errorf("recv: %w", err)
		}
		switch r := resp.Response.(type) {
		case *extprocv3.ProcessingResponse_RequestHeaders:
			ep := endpointOf(r.RequestHeaders)
			if ep == "" {
				ep = metadataEndpoint(resp)
			}
			_ = stream.CloseSend()
			if ep == "" {
				return "", fmt.Errorf("request-headers response without %s", destinationHeader)
			}
			return ep, nil
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			ir := r.ImmediateResponse
			return "", fmt.Errorf("immediate response %d: %s", ir.GetStatus().GetCode(), string(ir.GetBody()))
		}
	}
}

func metadataEndpoint(resp *extprocv3.ProcessingResponse) string {
	lb := resp.GetDynamicMetadata().GetFields()["envoy.lb"].GetStructValue()
	return lb.GetFields()[destinationHeader].GetStringValue()
}

func main() {
	o := parseFlags()
	creds := insecure.NewCredentials()
	if o.tls {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec // self-signed EPP
	}
	conn, err := grpc.NewClient(o.addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		fmt.Fprintf(os.Stderr, "pickclient: %v\n", err)
		os.Exit(1)
	}
	defer conn.Close()
	client := extprocv3.NewExternalProcessorClient(conn)
	if o.listen != "" {
		if err := serveGateway(o, client); err != nil {
			fmt.Fprintf(os.Stderr, "pickclient: %v\n", err)
			os.Exit(1)
		}
		return
	}
	out := json.NewEncoder(os.Stdout)
	failed := 0
	for i := 0; i < o.count; i++ {
		ep, err := pick(context.Background(), client, o)
		if err != nil {
			failed++
			_ = out.Encode(map[string]string{"error": err.Error()})
			continue
		}
		_ = out.Encode(map[string]string{"endpoint": ep})
	}
	if failed > 0 {
		os.Exit(1)
	}
}
