package telemetry

import (
	"math"

	"go.opentelemetry.io/otel/attribute"
	"google.golang.org/protobuf/encoding/protowire"
)

// The spans are written straight in OTLP's protobuf encoding
// (opentelemetry/proto/trace/v1/trace.proto), with protobuf's own wire
// primitives: building them as the SDK's spans and then as the generated
// messages cost 14 µs and 105 allocations a request, 4 µs of it the
// generated code's marshalling alone; written here, a span is one pass
// over the record into a buffer kept from batch to batch. The functions
// below append one field each; a message's fields are its number's.

// The fields of trace.proto's messages that tokentap writes.
const (
	scopeSpansSpans protowire.Number = 2 // ScopeSpans

	spanTraceID    protowire.Number = 1 // Span
	spanSpanID     protowire.Number = 2
	spanTraceState protowire.Number = 3
	spanParentID   protowire.Number = 4
	spanName       protowire.Number = 5
	spanKind       protowire.Number = 6
	spanStart      protowire.Number = 7
	spanEnd        protowire.Number = 8
	spanAttributes protowire.Number = 9
	spanEvents     protowire.Number = 11
	spanStatus     protowire.Number = 15
	spanFlags      protowire.Number = 16

	eventTime protowire.Number = 1 // Span.Event
	eventName protowire.Number = 2

	statusMessage protowire.Number = 2 // Status
	statusCode    protowire.Number = 3

	resourceAttributes protowire.Number = 1 // resource.proto's Resource

	keyValueKey   protowire.Number = 1 // common.proto's KeyValue
	keyValueValue protowire.Number = 2

	anyString protowire.Number = 1 // common.proto's AnyValue, a oneof
	anyBool   protowire.Number = 2
	anyInt    protowire.Number = 3
	anyDouble protowire.Number = 4
	anyArray  protowire.Number = 5

	arrayValues protowire.Number = 1 // common.proto's ArrayValue
)

// The enumerations' values tokentap writes.
const (
	kindServer = 2 // Span.SpanKind
	kindClient = 3

	statusError = 2 // Status.StatusCode

	flagSampled       = 0x01  // W3C trace flags, the low byte of Span.flags
	flagHasIsRemote   = 0x100 // SpanFlags: whether the parent is remote is known
	flagParentsRemote = 0x200 // SpanFlags: the parent is remote
)

func appendString(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendString(b, s)
}

func appendBytes(b []byte, num protowire.Number, v []byte) []byte {
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendBytes(b, v)
}

func appendVarint(b []byte, num protowire.Number, v uint64) []byte {
	if v == 0 {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.VarintType)
	return protowire.AppendVarint(b, v)
}

func appendFixed64(b []byte, num protowire.Number, v uint64) []byte {
	b = protowire.AppendTag(b, num, protowire.Fixed64Type)
	return protowire.AppendFixed64(b, v)
}

func appendFixed32(b []byte, num protowire.Number, v uint32) []byte {
	b = protowire.AppendTag(b, num, protowire.Fixed32Type)
	return protowire.AppendFixed32(b, v)
}

// stringValueSize is the size of an AnyValue holding s.
func stringValueSize(s string) int {
	return protowire.SizeTag(anyString) + protowire.SizeBytes(len(s))
}

// valueSize is the size of the AnyValue v is written as (appendValue).
func valueSize(v attribute.Value) int {
	switch v.Type() {
	case attribute.BOOL:
		return protowire.SizeTag(anyBool) + 1
	case attribute.INT64:
		return protowire.SizeTag(anyInt) + protowire.SizeVarint(uint64(v.AsInt64()))
	case attribute.FLOAT64:
		return protowire.SizeTag(anyDouble) + protowire.SizeFixed64()
	case attribute.STRINGSLICE:
		return protowire.SizeTag(anyArray) + protowire.SizeBytes(stringsSize(v.AsStringSlice()))
	}
	return stringValueSize(v.String())
}

// stringsSize is the size of an ArrayValue of strings.
func stringsSize(ss []string) int {
	n := 0
	for _, s := range ss {
		n += protowire.SizeTag(arrayValues) + protowire.SizeBytes(stringValueSize(s))
	}
	return n
}

// appendValue writes v's AnyValue fields: strings, booleans, integers,
// floats and lists of strings as themselves, any other type as its
// Value.String (only the resource's attributes, which tokentap does not
// choose, could be one).
func appendValue(b []byte, v attribute.Value) []byte {
	switch v.Type() {
	case attribute.BOOL:
		b = protowire.AppendTag(b, anyBool, protowire.VarintType)
		return protowire.AppendVarint(b, protowire.EncodeBool(v.AsBool()))
	case attribute.INT64:
		b = protowire.AppendTag(b, anyInt, protowire.VarintType)
		return protowire.AppendVarint(b, uint64(v.AsInt64()))
	case attribute.FLOAT64:
		b = protowire.AppendTag(b, anyDouble, protowire.Fixed64Type)
		return protowire.AppendFixed64(b, math.Float64bits(v.AsFloat64()))
	case attribute.STRINGSLICE:
		return appendStringsValue(b, v.AsStringSlice()...)
	}
	return appendStringValue(b, v.String())
}

// appendStringValue writes an AnyValue's string, present even when empty
// (a oneof's member is).
func appendStringValue(b []byte, s string) []byte {
	b = protowire.AppendTag(b, anyString, protowire.BytesType)
	return protowire.AppendString(b, s)
}

func appendStringsValue(b []byte, ss ...string) []byte {
	b = protowire.AppendTag(b, anyArray, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(stringsSize(ss)))
	for _, s := range ss {
		b = protowire.AppendTag(b, arrayValues, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(stringValueSize(s)))
		b = appendStringValue(b, s)
	}
	return b
}

// appendKeyValue writes kv as the KeyValue field num.
func appendKeyValue(b []byte, num protowire.Number, kv attribute.KeyValue) []byte {
	vs := valueSize(kv.Value)
	b = appendKeyValueHead(b, num, string(kv.Key), vs)
	return appendValue(b, kv.Value)
}

// appendAttributes writes kvs as a span's attributes.
func appendAttributes(b []byte, kvs []attribute.KeyValue) []byte {
	for _, kv := range kvs {
		b = appendKeyValue(b, spanAttributes, kv)
	}
	return b
}

// appendKeyValueHead writes a KeyValue's tag, its length, its key and
// the head of its value, whose AnyValue (of size vs) follows.
func appendKeyValueHead(b []byte, num protowire.Number, key string, vs int) []byte {
	size := protowire.SizeTag(keyValueKey) + protowire.SizeBytes(len(key)) + protowire.SizeTag(keyValueValue) + protowire.SizeBytes(vs)
	b = protowire.AppendTag(b, num, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(size))
	b = protowire.AppendTag(b, keyValueKey, protowire.BytesType)
	b = protowire.AppendString(b, key)
	b = protowire.AppendTag(b, keyValueValue, protowire.BytesType)
	return protowire.AppendVarint(b, uint64(vs))
}

// appendStringsKeyValue writes key and a list of strings as the KeyValue
// field num (attribute.StringSlice would copy the list twice).
func appendStringsKeyValue(b []byte, num protowire.Number, key string, ss ...string) []byte {
	vs := protowire.SizeTag(anyArray) + protowire.SizeBytes(stringsSize(ss))
	b = appendKeyValueHead(b, num, key, vs)
	return appendStringsValue(b, ss...)
}

// appendEvent writes a span event of a name and a time, without
// attributes.
func appendEvent(b []byte, name string, unixNano uint64) []byte {
	size := protowire.SizeTag(eventTime) + protowire.SizeFixed64() + protowire.SizeTag(eventName) + protowire.SizeBytes(len(name))
	b = protowire.AppendTag(b, spanEvents, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(size))
	b = appendFixed64(b, eventTime, unixNano)
	return appendString(b, eventName, name)
}

// appendErrorStatus writes the span's status: an error, with its
// description.
func appendErrorStatus(b []byte, message string) []byte {
	size := protowire.SizeTag(statusCode) + protowire.SizeVarint(statusError)
	if message != "" {
		size += protowire.SizeTag(statusMessage) + protowire.SizeBytes(len(message))
	}
	b = protowire.AppendTag(b, spanStatus, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(size))
	b = appendString(b, statusMessage, message)
	return appendVarint(b, statusCode, statusError)
}
