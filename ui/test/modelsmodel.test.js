import { test } from 'node:test';
import assert from 'node:assert/strict';
import { fmtGB, fitClass, catalogActions, progressOf, localKey, isLoopbackHost } from '../src/modelsmodel.js';

test('sizes are decimal GB', () => {
  assert.equal(fmtGB(18556686912), '19 GB');
  assert.equal(fmtGB(1311168), '0.001 GB');
  assert.equal(fmtGB(0), '0 GB');
  assert.equal(fmtGB(2.5e9), '2.5 GB');
});

test('only known verdict codes get a colour', () => {
  assert.equal(fitClass('fits'), 'fit-fits');
  assert.equal(fitClass('will_not_fit'), 'fit-will_not_fit');
  assert.equal(fitClass('something_new'), '');
});

test('a catalog row offers what its state allows', () => {
  const base = { status: 'available', bytes: 4e9, received: 0, partial: false };
  assert.deepEqual(catalogActions(base).map((a) => a.action), ['download']);
  const partial = { ...base, partial: true, received: 1e9 };
  assert.deepEqual(catalogActions(partial).map((a) => a.label), ['Resume (1.0 GB of 4.0 GB)', 'Delete partial download']);
  assert.deepEqual(catalogActions({ ...base, added: true }).map((a) => a.action), ['download', 'forget']);
  assert.deepEqual(catalogActions(base, { state: 'running' }).map((a) => a.action), ['cancel']);
  assert.deepEqual(catalogActions({ ...base, status: 'downloading' }).map((a) => a.action), ['cancel']);
  assert.deepEqual(catalogActions({ ...base, status: 'on_disk' }), []);
});

test('progress from a download event', () => {
  assert.equal(progressOf(null), null);
  assert.equal(progressOf({ state: 'done' }), null);
  const p = progressOf({ state: 'running', received: 5e8, total: 1e9, rate: 2e6, eta_s: 250, file: 'a.gguf', error: '' });
  assert.equal(p.value, 5e8);
  assert.equal(p.max, 1e9);
  assert.equal(p.text, '0.5 GB of 1.0 GB · 2.0 MB/s · 250 s left · a.gguf');
});

test('names and hosts', () => {
  assert.equal(localKey({ folder: 'set', name: 'a-00001-of-00002.gguf' }), 'set/a-00001-of-00002.gguf');
  assert.equal(localKey({ folder: '', name: 'a.gguf' }), 'a.gguf');
  assert.ok(isLoopbackHost('127.0.0.1') && isLoopbackHost('localhost') && isLoopbackHost('[::1]'));
  assert.ok(!isLoopbackHost('192.168.1.2') && !isLoopbackHost('example.com'));
});
