// Package helm checks the tokentap chart with Helm's own code: lint, and
// templates rendered with the default and the full values, parsed into
// Kubernetes objects and checked (probes, ports, the security context, the
// drain), the rendered config checked by tokentap itself (tokentap
// -check). It is a module of its own, so that tokentap's go.mod holds no
// Kubernetes module.
package helm

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tokentap/tokentap/proxy/testkit/tlstest"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

const chartDir = "tokentap"

// pushed is the image values push-image.sh prints.
var pushed = map[string]any{"image": map[string]any{"repository": "registry.example/platform/tokentap", "tag": "v1.2.3"}}

func values(t *testing.T, file string) map[string]any {
	t.Helper()
	if file == "" {
		return pushed
	}
	v, err := chartutil.ReadValuesFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// render renders the chart as an install of release "tt" in namespace
// "inference", returning the objects by kind (and name).
func render(t *testing.T, vals map[string]any) map[string][]map[string]any {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	rv, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{Name: "tt", Namespace: "inference", IsInstall: true}, chartutil.DefaultCapabilities)
	if err != nil {
		t.Fatal(err)
	}
	files, err := engine.Render(ch, rv)
	if err != nil {
		t.Fatal(err)
	}
	objs := map[string][]map[string]any{}
	for name, text := range files {
		if strings.HasSuffix(name, "NOTES.txt") {
			continue
		}
		for _, doc := range strings.Split(text, "\n---") {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			var o map[string]any
			if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
				t.Fatalf("%s: %v\n%s", name, err, doc)
			}
			if o == nil {
				continue
			}
			kind, _ := o["kind"].(string)
			objs[kind] = append(objs[kind], o)
			objs["doc:"+kind] = append(objs["doc:"+kind], map[string]any{"text": doc})
		}
	}
	return objs
}

func typed[T any](t *testing.T, objs map[string][]map[string]any, kind string) T {
	t.Helper()
	var v T
	docs := objs["doc:"+kind]
	if len(docs) != 1 {
		t.Fatalf("%d %s objects", len(docs), kind)
	}
	if err := yaml.UnmarshalStrict([]byte(docs[0]["text"].(string)), &v); err != nil {
		t.Fatalf("%s: %v", kind, err)
	}
	return v
}

func TestLint(t *testing.T) {
	for _, file := range []string{"", "values-full.yaml"} {
		l := lint.All(chartDir, values(t, file), "inference", false)
		for _, m := range l.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("lint %q: %s", file, m)
			}
		}
	}
}

// checkDeployment checks what every rendering must hold.
func checkDeployment(t *testing.T, d appsv1.Deployment, delay, timeout int64) corev1.Container {
	t.Helper()
	ps := d.Spec.Template.Spec
	if len(ps.Containers) != 1 {
		t.Fatalf("%d containers", len(ps.Containers))
	}
	c := ps.Containers[0]
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	if ports["http"] != 8080 || ports["admin"] != 9090 {
		t.Errorf("ports %v", ports)
	}
	if p := c.LivenessProbe; p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/healthz" || p.HTTPGet.Port.String() != "admin" {
		t.Errorf("liveness probe %+v", p)
	}
	if p := c.ReadinessProbe; p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/readyz" || p.HTTPGet.Port.String() != "admin" {
		t.Errorf("readiness probe %+v", p)
	}
	sc, psc := c.SecurityContext, ps.SecurityContext
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
		t.Errorf("security context %+v, pod's %+v", sc, psc)
	}
	if c.Lifecycle == nil || c.Lifecycle.PreStop == nil || c.Lifecycle.PreStop.Sleep == nil || c.Lifecycle.PreStop.Sleep.Seconds != delay {
		t.Errorf("preStop %+v, want a sleep of %d s", c.Lifecycle, delay)
	}
	if g := ps.TerminationGracePeriodSeconds; g == nil || *g != delay+timeout+15 {
		t.Errorf("terminationGracePeriodSeconds %v, want %d", g, delay+timeout+15)
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %+v", c.Resources)
	}
	return c
}

// configOf returns the rendered tokentap.yaml.
func configOf(t *testing.T, objs map[string][]map[string]any) string {
	t.Helper()
	cms := objs["ConfigMap"]
	if len(cms) != 1 {
		t.Fatalf("%d ConfigMaps", len(cms))
	}
	data := cms[0]["data"].(map[string]any)
	return data["tokentap.yaml"].(string)
}

// tokentapCheck runs tokentap -check on a rendered config whose files
// under /etc/tokentap are made in dir.
func tokentapCheck(t *testing.T, config string, dir string) {
	t.Helper()
	config = strings.ReplaceAll(config, "/etc/tokentap/", dir+"/")
	p := filepath.Join(dir, "tokentap.yaml")
	if err := os.WriteFile(p, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "run", "./cmd/tokentap", "-check", "-config", p)
	cmd.Dir = "../.."
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "config ok") {
		t.Fatalf("tokentap -check: %v\n%s", err, out)
	}
}

// The chart's image is the one examples/release/release.sh builds: a
// release's chart (its appVersion the release's) installs that version
// from ghcr.io/tokentap/tokentap; the checkout's chart (appVersion dev)
// refuses to render until image.tag names a version, saying how to build
// one; a registry of one's own (push-image.sh, which stamps the version
// and prints the values) is image.repository.
func TestImageIsTheOnePushed(t *testing.T) {
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	renderWith := func(vals map[string]any) (map[string]string, error) {
		rv, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{Name: "tt", Namespace: "inference", IsInstall: true}, chartutil.DefaultCapabilities)
		if err != nil {
			t.Fatal(err)
		}
		return engine.Render(ch, rv)
	}
	if _, err := renderWith(map[string]any{}); err == nil || !strings.Contains(err.Error(), "release.sh") {
		t.Fatalf("the checkout's chart rendered without an image tag: %v", err)
	}
	d := typed[appsv1.Deployment](t, render(t, values(t, "")), "Deployment")
	if img := d.Spec.Template.Spec.Containers[0].Image; img != "registry.example/platform/tokentap:v1.2.3" {
		t.Fatalf("image %q", img)
	}
	ch.Metadata.AppVersion = "v2.0.0" // as release.sh packs it
	out, err := renderWith(map[string]any{})
	if err != nil {
		t.Fatalf("a release's chart: %v", err)
	}
	if dep := out["tokentap/templates/deployment.yaml"]; !strings.Contains(dep, "image: \"ghcr.io/tokentap/tokentap:v2.0.0\"") {
		t.Errorf("a release's chart does not install its release's image:\n%s", dep)
	}
	cmd := exec.Command("bash", "push-image.sh", "registry.example/platform/tokentap", "v1.2.3")
	cmd.Env = append(os.Environ(), "DRY_RUN=1")
	o, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, o)
	}
	for _, want := range []string{"+ docker build --build-arg VERSION=v1.2.3 -t registry.example/platform/tokentap:v1.2.3 .",
		"+ docker push registry.example/platform/tokentap:v1.2.3", "--set image.repository=registry.example/platform/tokentap --set image.tag=v1.2.3", "helm template"} {
		if !strings.Contains(string(o), want) {
			t.Errorf("push-image.sh lacks %q:\n%s", want, o)
		}
	}
}

func TestRenderDefaults(t *testing.T) {
	objs := render(t, values(t, ""))
	d := typed[appsv1.Deployment](t, objs, "Deployment")
	c := checkDeployment(t, d, 5, 60)
	if strings.Join(c.Args, " ") != "-config /etc/tokentap/config/tokentap.yaml -watch-config" {
		t.Errorf("args %q", c.Args)
	}
	if _, ok := d.Spec.Template.Annotations["checksum/config"]; ok {
		t.Error("reload: watch must not roll the pods on a config change")
	}
	svc := typed[corev1.Service](t, objs, "Service")
	if len(svc.Spec.Ports) != 2 || svc.Spec.Ports[0].Port != 8080 || svc.Spec.Ports[1].Port != 9090 {
		t.Errorf("service ports %+v", svc.Spec.Ports)
	}
	for _, k := range []string{"ServiceMonitor", "PrometheusRule", "Secret"} {
		if len(objs[k]) != 0 {
			t.Errorf("a %s without its values", k)
		}
	}
	cfg := configOf(t, objs)
	for _, want := range []string{"listen: :8080", "listen: :9090", "drain_delay: 0s", "drain_timeout: 60s", "upstream: http://vllm:8000"} {
		if !strings.Contains(cfg, want) {
			t.Errorf("config lacks %q:\n%s", want, cfg)
		}
	}
	tokentapCheck(t, cfg, t.TempDir())
}

func TestRenderFullValues(t *testing.T) {
	objs := render(t, values(t, "values-full.yaml"))
	d := typed[appsv1.Deployment](t, objs, "Deployment")
	c := checkDeployment(t, d, 10, 300)
	if *d.Spec.Replicas != 3 || c.Image != "registry.example/tokentap:v1.2.3" {
		t.Errorf("replicas %d image %s", *d.Spec.Replicas, c.Image)
	}
	if d.Spec.Template.Annotations["checksum/config"] == "" || strings.Contains(strings.Join(c.Args, " "), "-watch-config") {
		t.Error("reload: restart must roll the pods on a config change, and not watch")
	}
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		mounts[m.Name] = m.MountPath
	}
	if mounts["admin-token"] != "/etc/tokentap/admin" || mounts["tls"] != "/etc/tokentap/tls" || mounts["redis"] != "/etc/tokentap/redis" {
		t.Errorf("mounts %v", mounts)
	}
	if len(objs["Secret"]) != 1 || len(objs["ServiceMonitor"]) != 1 || len(objs["PrometheusRule"]) != 1 {
		t.Fatalf("secret %d, servicemonitor %d, prometheusrule %d", len(objs["Secret"]), len(objs["ServiceMonitor"]), len(objs["PrometheusRule"]))
	}
	sm := objs["ServiceMonitor"][0]["spec"].(map[string]any)["endpoints"].([]any)[0].(map[string]any)
	if sm["port"] != "admin" || sm["path"] != "/metrics" || sm["bearerTokenSecret"] == nil {
		t.Errorf("servicemonitor endpoint %v", sm)
	}
	// The PrometheusRule holds the rules of examples/prometheus, which the
	// chart keeps a copy of.
	rules, err := os.ReadFile("../prometheus/tokentap-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	copied, _ := os.ReadFile("tokentap/files/tokentap-rules.yml")
	if string(rules) != string(copied) {
		t.Error("tokentap/files/tokentap-rules.yml differs from examples/prometheus/tokentap-rules.yml: copy it again")
	}
	var want map[string]any
	if err := yaml.Unmarshal(rules, &want); err != nil {
		t.Fatal(err)
	}
	groups := objs["PrometheusRule"][0]["spec"].(map[string]any)["groups"].([]any)
	if len(groups) != len(want["groups"].([]any)) || len(groups) == 0 {
		t.Errorf("%d rule groups, want %d", len(groups), len(want["groups"].([]any)))
	}
	cfg := configOf(t, objs)
	for _, want := range []string{"token_file: /etc/tokentap/admin/token", "client_ca_file: /etc/tokentap/tls/ca.crt", `min_version: "1.3"`,
		"addr: redis-master.redis:6379", "password_file: /etc/tokentap/redis/password", "endpoint: http://otel-collector.observability:4318",
		"websocket: true", "drain_timeout: 300s"} {
		if !strings.Contains(cfg, want) {
			t.Errorf("config lacks %q:\n%s", want, cfg)
		}
	}
	// The files the pod would mount, made here, and tokentap's own check.
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "cluster")
	cert, key := tlstest.Files(t, ca.Issue(t, false))
	for name, from := range map[string]string{"tls/tls.crt": cert, "tls/tls.key": key, "tls/ca.crt": ca.File(t)} {
		b, _ := os.ReadFile(from)
		write(t, filepath.Join(dir, name), string(b))
	}
	write(t, filepath.Join(dir, "admin/token"), "a-token-of-at-least-16-characters\n")
	write(t, filepath.Join(dir, "redis/password"), "secret\n")
	tokentapCheck(t, cfg, dir)
}

func write(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}
