package main

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"go.yaml.in/yaml/v3"
)

// nodeError is a decoding error at one value node of the file: a custom
// unmarshaler (duration, share) knows the exact node it refused, so the
// error names that node's key even when several keys share a line (a flow
// mapping such as `slo: {ttft: 500, target: 99%}`).
type nodeError struct {
	line, column int
	msg          string
}

func (e *nodeError) Error() string { return fmt.Sprintf("line %d: %s", e.line, e.msg) }

// valueError refuses the scalar n: `"500" is not a duration`.
func valueError(n *yaml.Node, why string) error {
	return &nodeError{line: n.Line, column: n.Column, msg: fmt.Sprintf("%q %s", n.Value, why)}
}

// keyPos is one mapping key of the file: its dotted path
// (routes[0].upstream), where the key sits and where its value starts.
type keyPos struct {
	path             string
	line, column     int
	valLine, valCol  int
	value            string // the value when it is a scalar
	scalar, sequence bool
}

// positions indexes every key of a file, so that an error that only knows
// a line (yaml's own) or a node (ours) can name the key it is about.
type positions struct {
	keys  []keyPos
	lines map[string]int // path → line of its key (or of its sequence item)
}

func indexFile(root *yaml.Node) *positions {
	p := &positions{lines: map[string]int{}}
	p.walk(root, "")
	sort.SliceStable(p.keys, func(i, j int) bool {
		a, b := p.keys[i], p.keys[j]
		return a.line < b.line || a.line == b.line && a.column < b.column
	})
	return p
}

func (p *positions) walk(n *yaml.Node, path string) {
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			p.walk(c, path)
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			kp := k.Value
			if path != "" {
				kp = path + "." + k.Value
			}
			p.lines[kp] = k.Line
			p.keys = append(p.keys, keyPos{path: kp, line: k.Line, column: k.Column, valLine: v.Line, valCol: v.Column,
				value: v.Value, scalar: v.Kind == yaml.ScalarNode})
			p.walk(v, kp)
		}
	case yaml.SequenceNode:
		for i, c := range n.Content {
			ip := fmt.Sprintf("%s[%d]", path, i)
			p.lines[ip] = c.Line
			p.keys = append(p.keys, keyPos{path: ip, line: c.Line, column: c.Column, valLine: c.Line, valCol: c.Column,
				value: c.Value, scalar: c.Kind == yaml.ScalarNode, sequence: true})
			p.walk(c, ip)
		}
	}
}

// locate turns one decoding error into "file:line: key: message". It
// names the key the error is about: the key of the exact node for our own
// errors; for yaml's, the key named in an unknown-field error or the key
// whose scalar value the type error quotes, on the error's line.
func (p *positions) locate(file string, err error) string {
	var ne *nodeError
	if errors.As(err, &ne) {
		return p.format(file, ne.line, p.atNode(ne.line, ne.column, ne.msg), ne.msg)
	}
	var out []string
	for _, msg := range strings.Split(cleanYAMLError(err), "\n") {
		msg = strings.TrimSpace(msg)
		if msg == "" {
			continue
		}
		var line int
		if _, err := fmt.Sscanf(msg, "line %d:", &line); err != nil {
			out = append(out, file+": "+msg)
			continue
		}
		msg = strings.TrimSpace(strings.TrimPrefix(msg, fmt.Sprintf("line %d:", line)))
		out = append(out, p.format(file, line, p.onLine(line, msg), msg))
	}
	return strings.Join(out, "\n")
}

func (p *positions) format(file string, line int, path, msg string) string {
	if path != "" {
		msg = path + ": " + msg
	}
	return fmt.Sprintf("%s:%d: %s", file, line, msg)
}

// atNode is the key at line:column, or the key whose value starts there.
func (p *positions) atNode(line, column int, msg string) string {
	for _, k := range p.keys {
		if k.line == line && k.column == column && !k.sequence || k.valLine == line && k.valCol == column {
			return k.path
		}
	}
	return p.onLine(line, msg)
}

// onLine picks the key a yaml error on line is about: an unknown field
// names itself; a type error quotes the value it refused (cut to seven
// characters and "..." when long); otherwise the line's only key, or its
// last (the innermost of a block key and the flow mapping it opens).
func (p *positions) onLine(line int, msg string) string {
	var on []keyPos
	for _, k := range p.keys {
		if k.line == line || k.sequence && k.valLine == line {
			on = append(on, k)
		}
	}
	if len(on) == 0 {
		return ""
	}
	if name, ok := unknownField(msg); ok {
		for _, k := range on {
			if !k.sequence && (k.path == name || strings.HasSuffix(k.path, "."+name)) {
				return k.path
			}
		}
	}
	if v, ok := quotedValue(msg); ok {
		for _, k := range on {
			if k.scalar && (k.value == v || strings.HasSuffix(v, "...") && strings.HasPrefix(k.value, strings.TrimSuffix(v, "..."))) {
				return k.path
			}
		}
	}
	return on[len(on)-1].path
}

// unknownField reads the key out of "unknown field x".
func unknownField(msg string) (string, bool) {
	rest, ok := strings.CutPrefix(msg, "unknown field ")
	if !ok {
		return "", false
	}
	name, _, _ := strings.Cut(rest, " ")
	return name, name != ""
}

// quotedValue reads the value out of yaml's "cannot unmarshal !!str `abc`
// into int".
func quotedValue(msg string) (string, bool) {
	_, rest, ok := strings.Cut(msg, "`")
	if !ok {
		return "", false
	}
	v, _, ok := strings.Cut(rest, "`")
	return v, ok
}
