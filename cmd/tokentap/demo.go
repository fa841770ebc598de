package main

import (
	"errors"
	"io"
)

func runDemo(args []string, out io.Writer) error { return errors.New("todo") }
