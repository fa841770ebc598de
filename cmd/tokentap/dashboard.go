package main

import (
	"embed"
	"mime"
	"path"

	"github.com/valyala/fasthttp"
)

// dashboardFS is the dashboard: one page, its script and style, and the
// vendored chart library (dashboard/vendor/README). Everything is in the
// binary; the page loads nothing from elsewhere.
//
//go:embed dashboard
var dashboardFS embed.FS

// serveAsset answers with the dashboard file name, or 404.
func serveAsset(ctx *fasthttp.RequestCtx, name string) {
	b, err := dashboardFS.ReadFile(path.Join("dashboard", path.Clean("/" + name)[1:]))
	if err != nil || name == "" {
		ctx.SetStatusCode(fasthttp.StatusNotFound)
		ctx.SetBodyString("not found\n")
		return
	}
	ct := mime.TypeByExtension(path.Ext(name))
	if ct == "" {
		ct = "application/octet-stream"
	}
	ctx.SetContentType(ct)
	ctx.Response.Header.Set("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'")
	ctx.Response.Header.Set("X-Content-Type-Options", "nosniff")
	ctx.SetBody(b)
}
