package main

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// TestComposeExample: examples/compose parses; its services are the ones
// the README names, built from targets the Dockerfile has; each replica's
// tokentap config is one tokentap accepts, with its upstream and its Redis
// services of the file; Prometheus scrapes both replicas' admin listeners
// and loads the rules; Grafana's provisioning and the files it mounts
// exist.
func TestComposeExample(t *testing.T) {
	dir := "../../examples/compose"
	var compose struct {
		Services map[string]struct {
			Image   string   `yaml:"image"`
			Command []string `yaml:"command"`
			Build   struct {
				Context string `yaml:"context"`
				Target  string `yaml:"target"`
			} `yaml:"build"`
			Volumes []string `yaml:"volumes"`
			Ports   []string `yaml:"ports"`
		} `yaml:"services"`
	}
	b, err := os.ReadFile(filepath.Join(dir, "compose.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &compose); err != nil {
		t.Fatalf("compose.yaml: %v", err)
	}
	var names []string
	for n := range compose.Services {
		names = append(names, n)
	}
	slices.Sort(names)
	if strings.Join(names, ",") != "backend,grafana,prometheus,redis,tokentap-1,tokentap-2" {
		t.Fatalf("services %v", names)
	}
	dockerfile, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	// Every mounted file exists; every built target is the Dockerfile's.
	for name, s := range compose.Services {
		for _, v := range s.Volumes {
			src, _, _ := strings.Cut(v, ":")
			if _, err := os.Stat(filepath.Join(dir, src)); err != nil {
				t.Errorf("%s mounts %s: %v", name, src, err)
			}
		}
		if s.Build.Target != "" && !regexp.MustCompile(`(?m)^FROM .* AS `+regexp.QuoteMeta(s.Build.Target)+`$`).Match(dockerfile) {
			t.Errorf("%s builds target %q, which the Dockerfile lacks", name, s.Build.Target)
		}
		if s.Build.Target == "" && s.Image == "" {
			t.Errorf("%s has neither an image nor a build", name)
		}
	}
	for _, name := range []string{"tokentap-1", "tokentap-2"} {
		s := compose.Services[name]
		i := slices.Index(s.Command, "-config")
		if i < 0 || i+1 >= len(s.Command) || !slices.Contains(s.Command, ":9090") {
			t.Fatalf("%s: command %v", name, s.Command)
		}
		var cfgFile string
		for _, v := range s.Volumes {
			if src, dst, _ := strings.Cut(v, ":"); strings.HasPrefix(dst, s.Command[i+1]) {
				cfgFile = filepath.Join(dir, src)
			}
		}
		fc, err := loadFile(cfgFile)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		st, err := buildSettings(fc, flags{config: cfgFile})
		if err != nil {
			t.Fatalf("%s's config is not one tokentap accepts: %v", name, err)
		}
		store := st.proxy.Admission.Store
		if store == nil || store.Redis.Addr != "redis:6379" {
			t.Fatalf("%s: store %+v, want the compose file's redis", name, store)
		}
		if up := st.proxy.Routes[0].Upstream; up != "http://backend:8000" {
			t.Errorf("%s: upstream %s, want the compose file's backend", name, up)
		}
	}
	var prom struct {
		RuleFiles     []string `yaml:"rule_files"`
		ScrapeConfigs []struct {
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	b, err = os.ReadFile(filepath.Join(dir, "prometheus.yml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &prom); err != nil {
		t.Fatalf("prometheus.yml: %v", err)
	}
	if len(prom.ScrapeConfigs) != 1 || strings.Join(prom.ScrapeConfigs[0].StaticConfigs[0].Targets, ",") != "tokentap-1:9090,tokentap-2:9090" ||
		len(prom.RuleFiles) != 1 || !slices.ContainsFunc(compose.Services["prometheus"].Volumes, func(v string) bool { return strings.HasSuffix(v, ":"+prom.RuleFiles[0]+":ro") }) {
		t.Errorf("prometheus.yml: %+v", prom)
	}
	for _, f := range []string{"grafana/provisioning/datasources/prometheus.yaml", "grafana/provisioning/dashboards/tokentap.yaml"} {
		var v map[string]any
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := yaml.Unmarshal(b, &v); err != nil || v["apiVersion"] != 1 {
			t.Errorf("%s: %v %v", f, err, v)
		}
	}
}
