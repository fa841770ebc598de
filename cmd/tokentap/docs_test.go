package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Every link between tokentap's own pages resolves: the file exists and,
// when the link names an anchor, a heading or <a id> of that name is in
// it. The README points to docs/ for the reference; a page moved or a
// heading renamed would otherwise leave dead links.
func TestDocsLinksResolve(t *testing.T) {
	pages, _ := filepath.Glob("../../*.md")
	more, _ := filepath.Glob("../../docs/*.md")
	pages = append(pages, more...)
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	heading := regexp.MustCompile(`(?m)^#+ (.+)$`)
	anchorID := regexp.MustCompile(`<a id="([^"]+)">`)
	anchors := map[string]map[string]bool{}
	anchorsOf := func(path string) map[string]bool {
		if a, ok := anchors[path]; ok {
			return a
		}
		a := map[string]bool{}
		b, err := os.ReadFile(path)
		if err == nil {
			for _, m := range heading.FindAllStringSubmatch(string(b), -1) {
				s := strings.ToLower(m[1])
				s = regexp.MustCompile(`[^a-z0-9 \-]`).ReplaceAllString(s, "")
				a[strings.ReplaceAll(s, " ", "-")] = true
			}
			for _, m := range anchorID.FindAllStringSubmatch(string(b), -1) {
				a[m[1]] = true
			}
		}
		anchors[path] = a
		return a
	}
	checked := 0
	for _, page := range pages {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range link.FindAllStringSubmatch(string(b), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			path := page
			if file != "" {
				path = filepath.Join(filepath.Dir(page), file)
				if _, err := os.Stat(path); err != nil {
					t.Errorf("%s: a link to %s, which does not exist", page, target)
					continue
				}
			}
			if anchor != "" && strings.HasSuffix(path, ".md") && !anchorsOf(path)[anchor] {
				t.Errorf("%s: a link to %s, whose page has no such heading", page, target)
			}
			checked++
		}
	}
	if checked < 30 {
		t.Fatalf("only %d links checked", checked)
	}
}
