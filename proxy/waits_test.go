package proxy

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// maxTestSleeps bounds the time.Sleep calls in proxy's tests (its
// packages' too). A sleep stands only for real time a test's peer takes
// over a real socket, which no fake clock can stand in for (synctest's
// bubble holds no socket): a backend's prefill and token gaps, a slow
// client's upload or reads, a connection left idle past a socket's
// deadline. A test that waits for a state the proxy reaches on its own
// waits for the event (waitFor, waitUntil, a channel); one that tests
// time-dependent logic runs it on a fake clock (an injected now, or
// testing/synctest). The bound may only come down.
const maxTestSleeps = 60

// TestTestsWaitForEvents keeps the waits in proxy's tests honest: the
// sleeps within their bound, and no poll spelled out by hand (a loop that
// sleeps in its post statement) outside wait.For, where a slow machine's
// deadline would hide in each copy.
func TestTestsWaitForEvents(t *testing.T) {
	fset := token.NewFileSet()
	sleeps := 0
	err := filepath.Walk(".", func(p string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() || !strings.HasSuffix(p, "_test.go") {
			return err
		}
		f, err := parser.ParseFile(fset, p, nil, 0)
		if err != nil {
			return err
		}
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			ast.Inspect(fd.Body, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.CallExpr:
					if isSleep(n) {
						sleeps++
					}
				case *ast.ForStmt:
					if post, ok := n.Post.(*ast.ExprStmt); ok && isSleep(post.X) && !(filepath.ToSlash(filepath.Dir(p)) == "testkit/wait" && fd.Name.Name == "For") {
						t.Errorf("%s: %s polls by hand: wait with wait.For or wait.Until", fset.Position(n.Pos()), fd.Name.Name)
					}
				}
				return true
			})
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	switch {
	case sleeps > maxTestSleeps:
		t.Errorf("%d time.Sleep calls in proxy's tests, past the %d allowed: wait for the event, or put the logic on a fake clock (see maxTestSleeps)", sleeps, maxTestSleeps)
	case sleeps < maxTestSleeps:
		t.Logf("%d time.Sleep calls in proxy's tests: bring maxTestSleeps down from %d", sleeps, maxTestSleeps)
	}
}

func isSleep(e ast.Expr) bool {
	c, ok := e.(*ast.CallExpr)
	if !ok {
		return false
	}
	sel, ok := c.Fun.(*ast.SelectorExpr)
	if !ok || sel.Sel.Name != "Sleep" {
		return false
	}
	id, ok := sel.X.(*ast.Ident)
	return ok && id.Name == "time"
}
