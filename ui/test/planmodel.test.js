// The Plan screen's pure logic.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import { groupDecisions, decisionLine, speedRows, measuredNote, originNote } from '../src/planmodel.js';

const D = [
  { knob: 'regime', label: 'Streaming mode', group: 'notes', brief: 'Experts stream.' },
  { knob: 'cache-mb', label: 'Expert cache', group: 'set', brief: '703 MiB: what is left.' },
  { knob: 'threads', label: 'Compute threads', group: 'kept', brief: '1: your own setting.' },
  { knob: 'x', label: 'X', group: 'odd', brief: 'new group' },
];

test('decisions are grouped set, kept, notes, then any group the server adds', () => {
  const g = groupDecisions(D);
  assert.deepEqual(g.map((x) => x.key), ['set', 'kept', 'notes', 'other']);
  assert.equal(g[0].rows[0].knob, 'cache-mb');
  assert.deepEqual(groupDecisions([]), []);
});

test('a decision reads "label: brief"', () => {
  assert.equal(decisionLine(D[1]), 'Expert cache: 703 MiB: what is left.');
});

test('predicted beside measured', () => {
  const rows = speedRows({ predicted: { s_per_token: 0.302, cache_hit_pct: 38, s_per_token_worst: 1.69 }, measured: { s_per_token: 0.25, cache_hit_pct: 41.2, tokens: 30 } });
  assert.deepEqual(rows.map((r) => [r.label, r.predicted, r.measured]), [
    ['Decode', '0.302 s/token', '0.250 s/token'],
    ['Cache hits', '38 %', '41 %'],
    ['Worst case', '1.690 s/token', ''],
  ]);
  const bare = speedRows({ predicted: {} });
  assert.deepEqual(bare.map((r) => r.predicted), ['—']);
  assert.match(measuredNote({}), /after the model has answered/);
  assert.match(measuredNote({ measured: { tokens: 5 } }), /5 tokens/);
  assert.match(originNote({ from_last_load: true }), /loaded with/);
});
