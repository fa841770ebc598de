package proxy

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The code's bounds: no file over 600 lines, no function over 80 (90 in
// cmd/tokentap), no struct over 30 fields, no type's methods in more than
// 3 files; no package-level state in the relay's packages (a variable of
// a sync or sync/atomic type, a pool of spares aside: state belongs to its
// Proxy); nothing outside examples/ imports an example; each package under
// proxy/ imports only the relay's packages below it (walls). What passes one today is listed in structureDebt
// with its size now: it may shrink, never grow, and nothing new may join
// it. A bound kept by review alone drifts; this check keeps it.
const (
	maxFileLines   = 600
	maxFuncLines   = 80
	maxCmdFunc     = 90
	maxStructField = 30
	maxMethodFiles = 3
)

// hubs are the types whose methods are a request's steps, one file a
// step: the exchange's are exchange.go (its parts), serve.go (route,
// read, respond, refuse), steer.go (upstream, overload, admission),
// forward.go (attempts, failover), upgrade.go (tunnels) and finish.go
// (the end, the record). Their bound is that many files: a new step is a
// new file, weighed here, never a method put where it fits.
var hubs = map[string]int{"methods proxy.exchange": 6}

var structureDebt = map[string]int{
	"struct metrics/record.go Record": 74, // ClientProtocol (HTTP/2)
}

func TestStructureBounds(t *testing.T) {
	root := ".."
	fset := token.NewFileSet()
	found := map[string]int{}
	methodFiles := map[string]map[string]bool{}
	err := filepath.Walk(root, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if info.IsDir() && (info.Name() == "testdata" || info.Name() == "helm" || strings.HasPrefix(info.Name(), ".")) && p != root {
			return filepath.SkipDir
		}
		if info.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, p, nil, 0)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		rel = filepath.ToSlash(rel)
		if n := fset.File(f.Pos()).LineCount(); n > maxFileLines {
			found["file "+rel] = n
		}
		pkg := filepath.ToSlash(filepath.Dir(rel))
		for _, im := range f.Imports {
			if strings.Contains(im.Path.Value, "/tokentap/examples/") && !strings.HasPrefix(rel, "examples/") {
				t.Errorf("%s imports %s: the product imports no example", rel, im.Path.Value)
			}
			if ok, why := mayImport(pkg, strings.Trim(im.Path.Value, `"`)); !ok {
				t.Errorf("%s imports %s: %s", rel, im.Path.Value, why)
			}
		}
		if pkg == "proxy" || strings.HasPrefix(pkg, "proxy/") && !strings.HasPrefix(pkg, "proxy/testkit") { // the relay's, not its tests' kits
			for _, name := range packageState(f) {
				t.Errorf("%s: package-level state %s (it belongs to a Proxy or a part of one)", rel, name)
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.FuncDecl:
				lines, most := fset.Position(n.End()).Line-fset.Position(n.Pos()).Line+1, maxFuncLines
				if strings.HasPrefix(rel, "cmd/tokentap/") {
					most = maxCmdFunc
				}
				if lines > most {
					found["func "+rel+" "+n.Name.Name] = lines
				}
				if n.Recv != nil && len(n.Recv.List) > 0 {
					typ := n.Recv.List[0].Type
					if s, ok := typ.(*ast.StarExpr); ok {
						typ = s.X
					}
					if id, ok := typ.(*ast.Ident); ok {
						k := "methods " + pkg + "." + id.Name
						if methodFiles[k] == nil {
							methodFiles[k] = map[string]bool{}
						}
						methodFiles[k][filepath.Base(rel)] = true
					}
				}
			case *ast.TypeSpec:
				if st, ok := n.Type.(*ast.StructType); ok {
					fields := 0
					for _, f := range st.Fields.List {
						fields += max(len(f.Names), 1)
					}
					if fields > maxStructField {
						found["struct "+rel+" "+n.Name.Name] = fields
					}
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for k, files := range methodFiles {
		most := maxMethodFiles
		if h, ok := hubs[k]; ok {
			most = h
		}
		if len(files) > most {
			found[k] = len(files)
		}
	}
	for k, n := range found {
		debt, ok := structureDebt[k]
		switch {
		case !ok:
			t.Errorf("%s: %d, past its bound (%s)", k, n, bounds())
		case n > debt:
			t.Errorf("%s: %d, grown past the %d it was allowed (it may only shrink)", k, n, debt)
		}
	}
	for k, debt := range structureDebt {
		if _, ok := found[k]; !ok {
			t.Logf("%s is within its bound now: take it out of structureDebt (was %d)", k, debt)
		}
	}
}

// walls say, for each package under proxy/, which of the relay's own
// packages it may import (below it in the request's path), and why: what
// it does not name it cannot reach. A package not listed imports none of
// proxy/ but the internal ones.
var walls = map[string]struct {
	may []string
	why string
}{
	"proxy/measure":                      {nil, "the measurement imports nothing of the request path"},
	"proxy/downstream":                   {[]string{"proxy/measure"}, "the client's connection keeps its delivery counters for the measurement, and knows nothing else"},
	"proxy/upstream":                     {[]string{"proxy/admission/shed"}, "an upstream keeps its overload gate, and knows nothing of routes or clients"},
	"proxy/routing":                      {[]string{"proxy/upstream", "proxy/admission/shed", "proxy/admission/predict"}, "routing chooses among upstreams by what they predict"},
	"proxy/admission":                    {[]string{"proxy/admission/shed", "proxy/admission/predict"}, "admission decides on the gate and the tenants' limits alone"},
	"proxy/relay":                        {[]string{"proxy/downstream", "proxy/upstream"}, "the relay moves bytes between the two connections; the measurement is an interface to it"},
	"proxy/admission/shed":               {[]string{"proxy/admission/predict"}, "the gate judges on the model's prediction"},
	"proxy/admission/predict/predictsim": {[]string{"proxy/admission/predict"}, "the simulated server is the model's test bench"},
}

// mayImport reports whether package pkg (a path from the module's root)
// may import path, and why not.
func mayImport(pkg, path string) (bool, string) {
	const mod = "github.com/tokentap/tokentap/"
	rel, ok := strings.CutPrefix(path, mod)
	if !ok || pkg == "proxy" || !strings.HasPrefix(pkg, "proxy/") || strings.HasPrefix(pkg, "proxy/testkit") ||
		!strings.HasPrefix(rel, "proxy") || strings.HasPrefix(rel, "proxy/internal/") || strings.HasPrefix(rel, pkg+"/") {
		return true, ""
	}
	if rel == "proxy" {
		return false, "nothing under proxy/ imports proxy"
	}
	w, listed := walls[pkg]
	for _, m := range w.may {
		if rel == m || strings.HasPrefix(rel, m+"/") {
			return true, ""
		}
	}
	if !listed {
		return false, pkg + " imports none of proxy/ but the internal packages"
	}
	return false, w.why
}

// packageState names f's package-level variables of a sync or sync/atomic
// type (declared, or built by a composite literal), sync.Pool aside.
func packageState(f *ast.File) (names []string) {
	stateful := func(e ast.Expr) bool {
		if c, ok := e.(*ast.CompositeLit); ok {
			e = c.Type
		}
		sel, ok := e.(*ast.SelectorExpr)
		if !ok {
			return false
		}
		pkg, ok := sel.X.(*ast.Ident)
		return ok && (pkg.Name == "atomic" || pkg.Name == "sync" && sel.Sel.Name != "Pool")
	}
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.VAR {
			continue
		}
		for _, s := range g.Specs {
			vs := s.(*ast.ValueSpec)
			hit := vs.Type != nil && stateful(vs.Type)
			for _, v := range vs.Values {
				hit = hit || stateful(v)
			}
			if hit {
				for _, n := range vs.Names {
					names = append(names, n.Name)
				}
			}
		}
	}
	return names
}

func bounds() string {
	return fmt.Sprintf("files %d lines, functions %d (%d in cmd/tokentap), structs %d fields, methods in %d files",
		maxFileLines, maxFuncLines, maxCmdFunc, maxStructField, maxMethodFiles)
}

// The walls are checked against known truth: what a package may import,
// and what it may not.
func TestWalls(t *testing.T) {
	const mod = "github.com/tokentap/tokentap/"
	for _, c := range []struct {
		pkg, path string
		ok        bool
	}{
		{"proxy/measure", mod + "proxy/internal/sock", true},
		{"proxy/measure", mod + "proxy/downstream", false},
		{"proxy/measure", mod + "metrics", true},
		{"proxy/relay", mod + "proxy/measure", false},
		{"proxy/relay", mod + "proxy/upstream", true},
		{"proxy/routing", mod + "proxy/admission/predict/predictsim", true},
		{"proxy/upstream", mod + "proxy", false},
		{"proxy/internal/conf", mod + "proxy/measure", false},
		{"proxy/admission", mod + "proxy/admission/shed", true},
		{"proxy", mod + "proxy/relay", true},
	} {
		if ok, why := mayImport(c.pkg, c.path); ok != c.ok {
			t.Errorf("%s importing %s: %v (%s), want %v", c.pkg, c.path, ok, why, c.ok)
		}
	}
}
