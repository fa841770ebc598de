package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tokentap/tokentap/metrics/stats"
)

// runStats is `tokentap stats`: it reads /stats from a running tokentap's
// admin listener and prints it as a table, warnings below.
func runStats(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tokentap stats", flag.ContinueOnError)
	adminURL := fs.String("admin", "127.0.0.1:9090", "the admin listener: host:port, as tokentap's -admin, or a base URL (https://…); several, comma separated, merge their replicas into one table")
	window := fs.String("window", "5m", "1m, 5m, 15m, 1h or all")
	groupBy := fs.String("group-by", "", "labels to keep, comma separated (route,model,tenant,upstream,class; default the first four)")
	route := fs.String("route", "", "only this route")
	var ac adminClient
	ac.flags(fs)
	asJSON := fs.Bool("json", false, "print the JSON as it came")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if !stats.ValidWindow(*window) {
		return fmt.Errorf("-window must be 1m, 5m, 15m, 1h or all")
	}
	q := url.Values{"window": {*window}}
	if *groupBy != "" {
		q.Set("group_by", *groupBy)
	}
	if *route != "" {
		q.Set("route", *route)
	}
	if admins := strings.Split(*adminURL, ","); len(admins) > 1 {
		reps, err := sketchesOf(ctx, admins, ac, q)
		if err != nil {
			return err
		}
		rep, err := stats.MergeSketches(reps)
		if err != nil {
			return err
		}
		if *asJSON {
			return json.NewEncoder(out).Encode(rep)
		}
		fmt.Fprintf(out, "%d replicas merged: window %s (%.0f s covered), at %s (warnings: see each replica)\n", len(reps), rep.Window, rep.WindowS, rep.GeneratedAt.Format(time.RFC3339))
		printStats(out, rep)
		return nil
	}
	body, err := ac.get(ctx, *adminURL, "/stats?"+q.Encode())
	if err != nil {
		return err
	}
	if *asJSON {
		_, err := out.Write(body)
		return err
	}
	var rep stats.Report
	if err := json.Unmarshal(body, &rep); err != nil {
		return fmt.Errorf("/stats: %w", err)
	}
	fmt.Fprintf(out, "window %s (%.0f s covered), at %s\n", rep.Window, rep.WindowS, rep.GeneratedAt.Format(time.RFC3339))
	printStats(out, rep)
	return nil
}

// sketchesOf reads the query q as sketches (/stats?format=sketch) from
// every admin listener of admins, to merge.
func sketchesOf(ctx context.Context, admins []string, ac adminClient, q url.Values) ([]stats.SketchReport, error) {
	q.Set("format", "sketch")
	var reps []stats.SketchReport
	for _, adm := range admins {
		body, err := ac.get(ctx, strings.TrimSpace(adm), "/stats?"+q.Encode())
		if err != nil {
			return nil, err
		}
		var r stats.SketchReport
		if err := json.Unmarshal(body, &r); err != nil {
			return nil, fmt.Errorf("%s/stats?format=sketch: %w", adm, err)
		}
		reps = append(reps, r)
	}
	return reps, nil
}

// adminBase turns -admin into a base URL: host:port (as tokentap's own
// -admin flag takes it; an empty host is this machine) or an http(s) URL.
func adminBase(s string) (string, error) {
	if !strings.Contains(s, "://") {
		host, port, err := net.SplitHostPort(s)
		if err != nil {
			return "", fmt.Errorf("%q is neither host:port nor an http(s) URL", s)
		}
		if host == "" || host == "0.0.0.0" || host == "::" {
			host = "127.0.0.1"
		}
		s = "http://" + net.JoinHostPort(host, port)
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("%q is neither host:port nor an http(s) URL", s)
	}
	return strings.TrimRight(s, "/"), nil
}

// adminClient is how the commands reach an admin listener: its bearer
// token and, for a TLS listener of a private CA, that CA.
type adminClient struct {
	tokenFile, caFile string
}

// flags adds -token-file and -cacert to fs.
func (ac *adminClient) flags(fs *flag.FlagSet) {
	fs.StringVar(&ac.tokenFile, "token-file", "", "file holding the admin bearer token, if the listener asks for one")
	fs.StringVar(&ac.caFile, "cacert", "", "PEM file of the CA that signed a TLS admin listener's certificate (-admin https://…); SSL_CERT_FILE works too")
}

// get reads path from the admin listener at base, with the bearer token
// of tokenFile when one is given. An answer other than 200 is an error,
// its body returned with it.
func (ac adminClient) get(ctx context.Context, base, path string) ([]byte, error) {
	base, err := adminBase(base)
	if err != nil {
		return nil, fmt.Errorf("-admin: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+path, nil)
	if err != nil {
		return nil, fmt.Errorf("-admin: %w", err)
	}
	if ac.tokenFile != "" {
		tok, err := readToken(ac.tokenFile)
		if err != nil {
			return nil, fmt.Errorf("-token-file: %w", err)
		}
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	client := &http.Client{Timeout: 30 * time.Second}
	if ac.caFile != "" {
		pem, err := os.ReadFile(ac.caFile)
		if err != nil {
			return nil, fmt.Errorf("-cacert: %w", err)
		}
		pool, err := x509.SystemCertPool()
		if err != nil {
			pool = x509.NewCertPool()
		}
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("-cacert: %s holds no PEM certificate", ac.caFile)
		}
		client.Transport = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}
	}
	resp, err := client.Do(req)
	if err != nil {
		if strings.HasPrefix(base, "http://") && (errors.Is(err, io.EOF) || strings.Contains(err.Error(), "malformed HTTP")) {
			return nil, fmt.Errorf("cannot read %s: %w (a TLS admin listener? give -admin https://host:port, and -cacert for a private CA)", path, err)
		}
		return nil, fmt.Errorf("cannot read %s: %w", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("cannot read %s: %w", path, err)
	}
	if resp.StatusCode == http.StatusBadRequest && strings.Contains(string(body), "plain_http_to_tls_port") {
		return nil, fmt.Errorf("the admin listener at %s speaks TLS: give -admin https://%s (and -cacert for a private CA)", base, strings.TrimPrefix(base, "http://"))
	}
	if resp.StatusCode != http.StatusOK {
		return body, fmt.Errorf("%s answered %s: %s", path, resp.Status, strings.TrimSpace(string(body)))
	}
	return body, nil
}

// printReading prints how each group's streams read to a reader at their
// route's pace (docs/MEASUREMENT.md, "How the stream read"), where any
// was read: the scores' p99 is the low tail, and the hop that held most
// of the streams whose reader waited.
func printReading(out io.Writer, groups []stats.Group) {
	var rows []stats.Group
	for _, g := range groups {
		if g.Reading != nil {
			rows = append(rows, g)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(out, "\nhow streams read:")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	ups := byUpstream(rows)
	fmt.Fprintln(tw, "route\tmodel\ttenant\t"+ups.head+"streams\tQoE p50\tp99\tfluidity p50\tp99\tstalled\tstall ms p99\theld most by\t")
	for _, g := range rows {
		rd := g.Reading
		held, most := "-", 0.0
		for _, hop := range []string{"upstream", "gateway", "client"} {
			if s := rd.HeldShare[hop]; s > most {
				held, most = fmt.Sprintf("%s %.0f%%", hop, 100*s), s
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s%d\t%.3f\t%.3f\t%.3f\t%.3f\t%.1f%%\t%.1f\t%s\t\n", dash(g.Route), dash(g.Model), dash(g.Tenant), ups.cell(g),
			rd.Streams, rd.QoE.P50, rd.QoE.P99, rd.Fluidity.P50, rd.Fluidity.P99, 100*rd.StallRate, rd.StallMS.P99, held)
	}
	_ = tw.Flush()
}
