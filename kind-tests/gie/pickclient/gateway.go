package main

// The --listen mode: a minimal stand-in for a GIE gateway (no Gateway can be built here).
// Each HTTP request is read whole, the EPP is asked for an endpoint with the request's
// path, headers and body (pickFor), and the request goes to that endpoint; the answer is
// streamed back as it comes (server-sent events included). The ext_proc stream is closed
// once the pick is made: the response phase is not sent to the EPP, which the approximate
// prefix-cache scorer does not need (it records a pick when it makes it, in PreRequest).
//
// The picked endpoint is returned in the response header x-gateway-destination-endpoint.
// A failed pick answers 503 with the reason; GET /healthz answers 200.

import (
	"bytes"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

const maxBody = 16 << 20

func serveGateway(o options, client extprocv3.ExternalProcessorClient) error {
	transport := &http.Transport{
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, maxBody))
		if err != nil {
			http.Error(w, "read body: "+err.Error(), http.StatusBadRequest)
			return
		}
		opts := o
		opts.headers = nil
		for k, vs := range r.Header {
			lk := strings.ToLower(k)
			if lk == "content-length" || lk == "content-type" || lk == "connection" {
				continue
			}
			for _, v := range vs {
				opts.headers = append(opts.headers, lk+"="+v)
			}
		}
		msgs, err := bodyMessages(opts, r.URL.RequestURI(), body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		ep, err := pickFor(r.Context(), client, o, msgs)
		if err != nil {
			http.Error(w, "pick: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		target := &url.URL{Scheme: "http", Host: ep}
		proxy := &httputil.ReverseProxy{
			Rewrite: func(pr *httputil.ProxyRequest) {
				pr.SetURL(target)
				pr.Out.Host = ep
			},
			Transport:     transport,
			FlushInterval: -1, // stream each chunk as it comes
			ModifyResponse: func(resp *http.Response) error {
				resp.Header.Set(destinationHeader, ep)
				return nil
			},
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.ContentLength = int64(len(body))
		proxy.ServeHTTP(w, r)
	})
	srv := &http.Server{Addr: o.listen, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	log.Printf("pickclient: gateway on %s, EPP at %s", o.listen, o.addr)
	return fmt.Errorf("serve: %w", srv.ListenAndServe())
}
