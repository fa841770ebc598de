package main

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy"
)

// Values the config file and the flags spell their own way: -slo's
// objectives, and headers read from the environment and files.

// parseSLO reads -slo's objectives: key=duration pairs of ttft, ttfa,
// tpot and e2e, qoe=0.9 and target=0.99, comma-separated.
func parseSLO(s string) (metrics.SLO, error) {
	var slo metrics.SLO
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok {
			return slo, fmt.Errorf("-slo: %q is not key=value (ttft=500ms,tpot=50ms)", kv)
		}
		if k == "qoe" || k == "target" {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || f <= 0 || f > 1 {
				return slo, fmt.Errorf("-slo: %s %q is not a share above 0 and at most 1", k, v)
			}
			if k == "qoe" {
				slo.QoE = f
			} else {
				slo.Target = f
			}
			continue
		}
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return slo, fmt.Errorf("-slo: %s=%q is not a positive duration (500ms)", k, v)
		}
		switch k {
		case "ttft":
			slo.TTFT = d
		case "ttfa":
			slo.TTFA = d
		case "tpot":
			slo.TPOT = d
		case "e2e":
			slo.E2E = d
		default:
			return slo, fmt.Errorf("-slo: unknown objective %q (ttft, ttfa, tpot, e2e, qoe, target)", k)
		}
	}
	return slo, nil
}

// secretRef is a reference to a secret in a header's value: ${env:NAME}
// or ${file:PATH}.
var secretRef = regexp.MustCompile(`\$\{(env|file):([^}]*)\}`)

// headers reads a headers mapping of field (routes[0].headers), its values'
// ${env:NAME} and ${file:PATH} replaced by the variable's value or the
// file's content (trailing line breaks and spaces trimmed). Read at start
// and at every reload; an error names the field and the variable or file,
// never a value.
func headers(m map[string]string, field string) ([]proxy.Header, error) {
	names := slices.Sorted(maps.Keys(m))
	var out []proxy.Header
	for _, name := range names {
		var err error
		v := secretRef.ReplaceAllStringFunc(m[name], func(ref string) string {
			parts := secretRef.FindStringSubmatch(ref)
			switch {
			case err != nil:
				return ""
			case parts[2] == "":
				err = fmt.Errorf("%s.%s: %s names no %s", field, name, ref, parts[1])
				return ""
			case parts[1] == "env":
				val, ok := os.LookupEnv(parts[2])
				if !ok {
					err = fmt.Errorf("%s.%s: the environment variable %s is not set", field, name, parts[2])
				}
				return val
			}
			b, rerr := os.ReadFile(parts[2])
			if rerr != nil {
				err = fmt.Errorf("%s.%s: cannot read %s: %v", field, name, parts[2], errors.Unwrap(rerr))
			}
			return strings.TrimRight(string(b), " \t\r\n")
		})
		if err != nil {
			return nil, err
		}
		out = append(out, proxy.Header{Name: name, Value: v})
	}
	return out, nil
}
