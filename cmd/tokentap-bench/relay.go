package main

import (
	"errors"
	"flag"
	"io"
	"log"
	"net"
	"syscall"
	"time"
)

// runRelay is the bench's floor for a Go proxy: a TCP relay with a
// goroutine per direction and io.Copy, no HTTP parsing, no measurement.
// Each client connection gets its own upstream connection, so HTTP/1.1
// keep-alive passes through unchanged. What it costs per token is what Go's
// runtime and the kernel cost any goroutine-per-connection proxy in the
// same run; what tokentap costs above it is tokentap's own work.
func runRelay(args []string) error {
	listen, upstream, err := relayFlags("relay", "127.0.0.1:8091", args)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	for {
		c, err := ln.Accept()
		if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
			time.Sleep(5 * time.Millisecond) // out of descriptors: wait for some to close
			continue
		}
		if err != nil {
			return err
		}
		go relayConn(c, upstream)
	}
}

// relayFlags parses a relay subcommand's flags: the address it listens on
// (listen by default) and the upstream's host:port.
func relayFlags(name, listen string, args []string) (string, string, error) {
	fs := flag.NewFlagSet("tokentap-bench "+name, flag.ContinueOnError)
	l := fs.String("listen", listen, "address to accept on")
	upstream := fs.String("upstream", "127.0.0.1:8000", "host:port to relay to")
	err := fs.Parse(args)
	return *l, *upstream, err
}

func relayConn(c net.Conn, upstream string) {
	defer c.Close()
	u, err := net.Dial("tcp", upstream)
	if err != nil {
		log.Print(err)
		return
	}
	defer u.Close()
	go func() {
		_, _ = io.Copy(u, c)
		_ = u.(*net.TCPConn).CloseWrite()
	}()
	_, _ = io.Copy(c, u)
}
