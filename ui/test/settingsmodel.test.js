// The settings form's logic over the parameter table's shapes.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import {
  groupRows, rowVisible, displayValue, typicalText, numberMode, parseNumber, commandLine,
  shellQuote, sameValue, labelsOf,
} from '../src/settingsmodel.js';

const P = [
  { key: 'model', label: 'Model file', type: 'path', group: 'model', group_label: 'Model', group_help: 'The model.', group_order: 1, group_read_only: true, level: 'basic', form: true, scope: 'session' },
  { key: 'n-predict', label: 'Max tokens', type: 'int', group: 'generation', group_label: 'Generation', group_help: 'g', group_order: 2, level: 'basic', form: true, unit: 'tokens', special: [{ value: 0, label: 'up to the context' }], default: 0 },
  { key: 'temp', label: 'Temperature', type: 'float', group: 'sampling', group_label: 'Sampling', group_order: 3, level: 'basic', form: true, special: [{ value: 0.0, label: 'greedy' }] },
  { key: 'threads-batch', label: 'Prefill threads', type: 'int', group: 'generation', group_label: 'Generation', group_order: 2, level: 'advanced', form: false },
  { key: 'cache-mb', label: 'Expert cache', type: 'int', group: 'cache', group_label: 'Expert cache', group_order: 5, level: 'basic', form: true, unit: 'MiB', typical: { min: 1500, max: 8192 }, special: [{ value: 0, label: 'off' }], accepts_auto: true, default: 'auto' },
  { key: 'force-cache', label: 'Force cache size', type: 'bool', group: 'diagnostics', group_label: 'Diagnostics', group_order: 10, level: 'debug', form: false },
  { key: 'dense-weights', label: 'Dense weights', type: 'choice', group: 'memory', group_label: 'Memory', group_order: 6, level: 'advanced', form: false, choices: [{ value: 'mmap', label: 'file mapping' }, { value: 'anon', label: 'process memory' }] },
  { key: 'seed', label: 'Seed', type: 'int', group: 'sampling', group_label: 'Sampling', group_order: 3, level: 'advanced', form: true, special: [{ value: 4294967295, label: 'random per run' }] },
];

test('groups follow group_order, not the rows’ places in the table', () => {
  const groups = groupRows(P, 'debug');
  assert.deepEqual(groups.map((g) => g.key), ['model', 'generation', 'sampling', 'cache', 'memory', 'diagnostics']);
  assert.deepEqual(groups[1].rows.map((r) => r.key), ['n-predict', 'threads-batch']);
  assert.deepEqual(groups[2].rows.map((r) => r.key), ['temp', 'seed']);
  assert.equal(groups[0].label, 'Model');
  assert.equal(groups[0].help, 'The model.');
  assert.equal(groups[0].readOnly, true);
});

test('the form shows form rows by default; the level filter widens it', () => {
  assert.deepEqual(groupRows(P, 'form').flatMap((g) => g.rows.map((r) => r.key)), ['model', 'n-predict', 'temp', 'seed', 'cache-mb']);
  assert.deepEqual(groupRows(P, 'basic').flatMap((g) => g.rows.map((r) => r.key)), ['model', 'n-predict', 'temp', 'cache-mb']);
  assert.ok(groupRows(P, 'advanced').some((g) => g.rows.some((r) => r.key === 'dense-weights')));
  assert.ok(!groupRows(P, 'advanced').some((g) => g.rows.some((r) => r.key === 'force-cache')));
  assert.ok(groupRows(P, 'debug').some((g) => g.rows.some((r) => r.key === 'force-cache')));
});

test('a row the person set shows whatever the filter', () => {
  const fc = P.find((p) => p.key === 'force-cache');
  assert.equal(rowVisible(fc, 'form', []), false);
  assert.equal(rowVisible(fc, 'form', ['force-cache']), true);
});

test('special values, choices and auto are shown by label', () => {
  const cache = P.find((p) => p.key === 'cache-mb');
  assert.equal(displayValue(cache, 0), 'off');
  assert.equal(displayValue(cache, 'auto'), 'auto');
  assert.equal(displayValue(cache, 2048), '2048 MiB');
  assert.equal(displayValue(P.find((p) => p.key === 'temp'), 0), 'greedy');
  assert.equal(displayValue(P.find((p) => p.key === 'seed'), 4294967295), 'random per run');
  assert.equal(displayValue(P.find((p) => p.key === 'dense-weights'), 'anon'), 'process memory');
  assert.equal(displayValue(P.find((p) => p.key === 'force-cache'), false), 'off');
});

test('typical is the shown range; limits are not', () => {
  assert.equal(typicalText(P.find((p) => p.key === 'cache-mb')), 'typically 1500–8192 MiB');
  assert.equal(typicalText(P.find((p) => p.key === 'n-predict')), '');
});

test('number modes: auto, a special, or a number', () => {
  const cache = P.find((p) => p.key === 'cache-mb');
  assert.equal(numberMode(cache, 'auto'), 'auto');
  assert.equal(numberMode(cache, 0), 'special:0');
  assert.equal(numberMode(cache, 4096), 'number');
});

test('what a person types is sent as a number when it is one, else as written', () => {
  const cache = P.find((p) => p.key === 'cache-mb');
  assert.equal(parseNumber(cache, ' 4096 '), 4096);
  assert.equal(parseNumber(cache, '1.5'), 1.5);
  assert.equal(parseNumber(cache, 'AUTO'), 'auto');
  assert.equal(parseNumber(cache, 'lots'), 'lots');
  assert.equal(parseNumber(P.find((p) => p.key === 'temp'), 'auto'), 'auto');
  assert.equal(parseNumber(cache, '0x10'), '0x10');
});

test('values compare by what they mean', () => {
  assert.ok(sameValue(1, 1.0));
  assert.ok(sameValue('auto', 'auto'));
  assert.ok(!sameValue(0, '0'));
});

test('copy as command quotes only what a shell would split', () => {
  assert.equal(commandLine(['--model', '/m/a b.gguf', '--cache-mb', 'auto', '--x', "it's"]),
    "bmoe-cli --model '/m/a b.gguf' --cache-mb auto --x 'it'\\''s'");
  assert.equal(shellQuote(''), "''");
  assert.equal(shellQuote('$(rm)'), "'$(rm)'");
});

test('labels of reload keys come from the table', () => {
  assert.deepEqual(labelsOf(P, ['cache-mb', 'temp', 'unknown']), ['Expert cache', 'Temperature', 'unknown']);
});
