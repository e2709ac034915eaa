// Metrics from token and done events; reconnect back-off.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import { Metrics, fmt, fmtMiB, fmtSeconds, sparkPoints } from '../src/metrics.js';
import { backoffMs, BACKOFF_MAX_MS } from '../src/events.js';

const tok = (step, extra = {}) => ({
  step, steps: 100, wall_ms: 100, flash_wait_ms: 50, read_mib: 10, cache_hit_pct: 60,
  cache_budget_mib: 2048, rss_mib: 3000, mem_available_mib: 5000, ...extra,
});

test('decode tok/s and flash MiB/s over the window', () => {
  const m = new Metrics({ window: 4 });
  for (let i = 1; i <= 10; i++) m.token(tok(i));
  const v = m.view();
  assert.equal(v.decodeTokS, 10); // 4 tokens in 400 ms
  assert.equal(v.flashMiBs, 200); // 40 MiB over 200 ms of waiting
  assert.equal(v.flashShare, 0.5);
  assert.equal(v.cacheHitPct, 60);
  assert.equal(v.cacheBudgetMiB, 2048);
  assert.equal(v.rssMiB, 3000);
  assert.equal(v.memAvailableMiB, 5000);
  assert.equal(v.cpuTempC, null);
  assert.equal(m.tokens, 10);
});

test('no flash wait means no flash rate; no cache means no hit rate', () => {
  const m = new Metrics();
  m.token(tok(1, { flash_wait_ms: 0, read_mib: 0, cache_hit_pct: -1, cpu_temp_c: 55 }));
  const v = m.view();
  assert.equal(v.flashMiBs, null);
  assert.equal(v.cacheHitPct, null);
  assert.equal(v.hasCache, false);
  assert.equal(v.cpuTempC, 55);
});

test('a new turn restarts the window', () => {
  const m = new Metrics({ window: 8 });
  for (let i = 1; i <= 5; i++) m.token(tok(i, { wall_ms: 1000 }));
  m.token(tok(1, { wall_ms: 10 }));
  assert.equal(m.view().decodeTokS, 100);
});

test('the last turn comes from done', () => {
  const m = new Metrics();
  m.done({ ttft_s: 0.5, prefill_tps: 300, prefill_s: 0.1, n_prompt: 30, cache_budget_mib: 100 });
  const v = m.view();
  assert.equal(v.ttftS, 0.5);
  assert.equal(v.prefillTps, 300);
  assert.equal(v.nPrompt, 30);
});

test('formatting', () => {
  assert.equal(fmt(null), '—');
  assert.equal(fmt(3.14159), '3.1');
  assert.equal(fmt(1234.5), '1,235');
  assert.equal(fmtMiB(512), '512 MiB');
  assert.equal(fmtMiB(2048), '2.00 GiB');
  assert.equal(fmtSeconds(0.0715), '72 ms');
  assert.equal(fmtSeconds(12.4), '12.4 s');
  assert.equal(fmtSeconds(125), '2 min 5 s');
});

test('sparkline points span the box', () => {
  assert.equal(sparkPoints([1], 100, 20), '');
  const pts = sparkPoints([0, 5, 10], 100, 20, 0).split(' ');
  assert.deepEqual(pts, ['0.0,20.0', '50.0,10.0', '100.0,0.0']);
});

test('back-off doubles, is jittered, honours Retry-After and is capped', () => {
  const mid = () => 0.5;
  assert.equal(backoffMs(0, 0, mid), 500);
  assert.equal(backoffMs(1, 0, mid), 1000);
  assert.equal(backoffMs(3, 0, mid), 4000);
  assert.equal(backoffMs(0, 2, mid), 2000);
  assert.equal(backoffMs(20, 0, mid), BACKOFF_MAX_MS);
  assert.equal(backoffMs(20, 0, () => 1), BACKOFF_MAX_MS);
  assert.equal(backoffMs(0, 0, () => 0), 375);
});
