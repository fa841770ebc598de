package main

// The config file's value types (a share, an increase, a duration, each
// read with an error naming its line) and the files a config names (the
// admin token, secrets, export headers), read without their content ever
// reaching an error.

import (
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// share is a fraction: 0.99 or "99%".
type share float64

func (s *share) UnmarshalYAML(n *yaml.Node) error {
	f, ok := fraction(n.Value)
	if !ok || f > 1 {
		return valueError(n, "is not a share (use 0.99 or 99%)")
	}
	*s = share(f)
	return nil
}

// increase is a relative increase, above 0 with no upper bound: 0.1 or
// "10%", 1.5 or "150%".
type increase float64

func (s *increase) UnmarshalYAML(n *yaml.Node) error {
	f, ok := fraction(n.Value)
	if !ok {
		return valueError(n, "is not an increase (use 0.1 or 10%, 1.5 or 150%)")
	}
	*s = increase(f)
	return nil
}

// fraction reads 0.99 or "99%" as a positive number.
func fraction(v string) (float64, bool) {
	v = strings.TrimSpace(v)
	div := 1.0
	if strings.HasSuffix(v, "%") {
		v, div = strings.TrimSuffix(v, "%"), 100
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || !(f/div > 0) || math.IsInf(f, 0) {
		return 0, false
	}
	return f / div, true
}

// duration is a Go duration string ("5s", "2m30s"); 0 means "not set".
type duration struct {
	d   time.Duration
	set bool
}

func (d *duration) UnmarshalYAML(n *yaml.Node) error {
	v, err := time.ParseDuration(n.Value)
	if err != nil || v < 0 {
		return valueError(n, "is not a duration (use Go syntax such as 500ms, 30s, 5m)")
	}
	d.d, d.set = v, true
	return nil
}

// readToken reads the admin bearer token: the file's first line, at least
// 16 characters.
func readToken(path string) (string, error) {
	tok, err := readSecretFile(path)
	if err != nil {
		return "", err
	}
	if len(tok) < 16 {
		return "", errors.New("the token must be at least 16 characters")
	}
	return tok, nil
}

// readSecretFile reads a secret (a password) from the first line of path;
// the error never carries the file's content.
func readSecretFile(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	s, _, _ := strings.Cut(string(b), "\n")
	s = strings.TrimSpace(s)
	if s == "" {
		return "", errors.New("the file's first line is empty")
	}
	return s, nil
}

// readHeadersFile reads export headers: one key=value (or key: value) a
// line, blank lines and # comments skipped. Errors name the line, never
// its value.
func readHeadersFile(path string) (map[string]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	h := map[string]string{}
	for i, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			k, v, ok = strings.Cut(line, ":")
		}
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if !ok || k == "" || strings.ContainsAny(k, " \t") {
			return nil, fmt.Errorf("line %d is not key=value", i+1)
		}
		h[k] = v
	}
	return h, nil
}
