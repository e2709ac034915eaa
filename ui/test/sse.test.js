// The SSE framing, fed in arbitrary pieces.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import { SSEParser } from '../src/sse.js';

function parse(pieces) {
  const events = [];
  const comments = [];
  const p = new SSEParser((e) => events.push(e), (c) => comments.push(c));
  for (const piece of pieces) p.feed(piece);
  return { events, comments };
}

const STREAM = 'event: state\ndata: {"a":1}\n\n: ping\n\ndata: {"b":2}\n\nevent: token\ndata: x\ndata: y\n\n';

test('events, names, comments and multi-line data', () => {
  const { events, comments } = parse([STREAM]);
  assert.deepEqual(events, [
    { event: 'state', data: '{"a":1}' },
    { event: 'message', data: '{"b":2}' },
    { event: 'token', data: 'x\ny' },
  ]);
  assert.deepEqual(comments, ['ping']);
});

test('any split of the stream gives the same events', () => {
  const whole = parse([STREAM]).events;
  for (let i = 1; i < STREAM.length; i++) {
    assert.deepEqual(parse([STREAM.slice(0, i), STREAM.slice(i)]).events, whole, `split at ${i}`);
  }
  assert.deepEqual(parse(STREAM.split('')).events, whole);
});

test('CRLF and CR line endings, even split between CR and LF', () => {
  const crlf = STREAM.replace(/\n/g, '\r\n');
  const cr = STREAM.replace(/\n/g, '\r');
  const whole = parse([STREAM]).events;
  assert.deepEqual(parse([crlf]).events, whole);
  assert.deepEqual(parse([cr]).events, whole);
  for (let i = 1; i < crlf.length; i++) {
    assert.deepEqual(parse([crlf.slice(0, i), crlf.slice(i)]).events, whole, `split at ${i}`);
  }
});

test('an event without a final blank line is not dispatched', () => {
  assert.deepEqual(parse(['data: partial\n']).events, []);
});

test('the waiting comment of a queued chat turn is reported', () => {
  assert.deepEqual(parse([': waiting for a turn\n\n']).comments, ['waiting for a turn']);
});
