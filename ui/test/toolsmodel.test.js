import { test } from 'node:test';
import assert from 'node:assert/strict';
import {
  applyTask, applyMcp, scheduleText, scheduleToForm, scheduleFromForm, whenText, lastRunText, nextRunText,
  skillGroups, toggleSkill, connectText, MCP_EXAMPLE,
} from '../src/toolsmodel.js';

test('task events upsert newest first and delete', () => {
  let list = [{ id: 'a', title: 'A', created: 1 }];
  list = applyTask(list, { id: 'b', title: 'B', created: 2 });
  assert.deepEqual(list.map((t) => t.id), ['b', 'a']);
  list = applyTask(list, { id: 'a', title: 'A2', created: 1, last_run: { state: 'running' } });
  assert.deepEqual(list.map((t) => t.title), ['B', 'A2']);
  assert.equal(list[1].last_run.state, 'running');
  list = applyTask(list, { id: 'b', title: 'B', created: 2, deleted: true });
  assert.deepEqual(list.map((t) => t.id), ['a']);
  assert.equal('deleted' in applyTask([], { id: 'c', created: 3, deleted: false })[0], false);
});

test('an mcp event replaces its server in place or adds it', () => {
  const one = { name: 'one', state: 'stopped', tools: [] };
  const two = { name: 'two', state: 'running', tools: [] };
  let list = applyMcp([one, two], { ...one, state: 'failed', error: 'It exited.' });
  assert.deepEqual(list.map((s) => [s.name, s.state]), [['one', 'failed'], ['two', 'running']]);
  list = applyMcp(list, { name: 'three', state: 'starting', tools: [] });
  assert.deepEqual(list.map((s) => s.name), ['one', 'two', 'three']);
});

test('schedules in words and through the form, both ways', () => {
  assert.equal(scheduleText(null), 'On demand only');
  assert.equal(scheduleText({ cron: '0 9 * * 1-5' }), 'Cron 0 9 * * 1-5');
  assert.equal(scheduleText({ every_s: 60 }), 'Every minute');
  assert.equal(scheduleText({ every_s: 7200 }), 'Every 2 hours');
  assert.equal(scheduleText({ every_s: 86400 }), 'Every day');
  assert.equal(scheduleText({ every_s: 90 }), 'Every 90 seconds');
  assert.deepEqual(scheduleFromForm('none', 'x'), { schedule: null });
  assert.deepEqual(scheduleFromForm('every', ' 15 '), { schedule: { every_s: 900 } });
  assert.match(scheduleFromForm('every', '0').error, /whole number of minutes/);
  assert.match(scheduleFromForm('every', '1.5').error, /whole number/);
  assert.deepEqual(scheduleFromForm('cron', ' 0  9 * * 1-5 '), { schedule: { cron: '0 9 * * 1-5' } });
  assert.match(scheduleFromForm('cron', '0 9 * *').error, /five fields/);
  for (const s of [null, { every_s: 900 }, { cron: '*/5 * * * *' }]) {
    const f = scheduleToForm(s);
    assert.deepEqual(scheduleFromForm(f.kind, f.value).schedule, s);
  }
});

test('times relative to now, next and last runs', () => {
  const now = 1_000_000;
  assert.equal(whenText(now + 10, now), 'in a moment');
  assert.equal(whenText(now - 10, now), 'just now');
  assert.equal(whenText(now + 300, now), 'in 5 min');
  assert.equal(whenText(now - 3 * 3600, now), '3 h ago');
  assert.equal(whenText(now - 3 * 86400, now), '3 days ago');
  assert.equal(whenText(null, now), '');
  const task = { enabled: true, next_run: now + 600, last_run: null };
  assert.equal(nextRunText(task, now), 'in 10 min');
  assert.equal(nextRunText({ ...task, enabled: false }, now), 'paused');
  assert.equal(nextRunText({ ...task, next_run: null }, now), '');
  assert.equal(lastRunText(task, now), '');
  assert.equal(lastRunText({ last_run: { state: 'running', at: now - 5 } }, now), 'running, just now');
  assert.equal(lastRunText({ last_run: { state: 'error', at: now - 120, error: 'The task\'s workspace was removed.' } }, now),
    'failed, 2 min ago: The task\'s workspace was removed.');
});

test('skills grouped, switched on and off', () => {
  const g = skillGroups([{ name: 'z', source: 'person' }, { name: 'b', source: 'bundled' }, { name: 'a', source: 'person' }]);
  assert.deepEqual(g.own.map((s) => s.name), ['a', 'z']);
  assert.deepEqual(g.bundled.map((s) => s.name), ['b']);
  assert.deepEqual(toggleSkill(['a'], 'b', true), ['a', 'b']);
  assert.deepEqual(toggleSkill(['a', 'b'], 'a', false), ['b']);
  assert.deepEqual(toggleSkill(['a'], 'a', true), ['a']);
  assert.deepEqual(toggleSkill(undefined, 'a', true), ['a']);
});

test('what a connect did, in a sentence', () => {
  assert.equal(connectText('Claude Code', { settings: '/h/.claude/settings.json', backup: '/h/.claude/settings.json.bmoe-backup-1', changed: true, note: null }),
    'Claude Code now uses this server: wrote /h/.claude/settings.json. The previous file is kept as /h/.claude/settings.json.bmoe-backup-1.');
  assert.equal(connectText('Codex', { settings: '/h/.codex/config.toml', backup: null, changed: true, note: 'Set BMOE_API_KEY to the server\'s key before starting Codex.' }),
    'Codex now uses this server: wrote /h/.codex/config.toml. Set BMOE_API_KEY to the server\'s key before starting Codex.');
  assert.match(connectText('opencode', { settings: '/x.json', backup: null, changed: false }), /already uses this server: \/x.json is unchanged/);
});

test('the mcp.json example is the mcpServers format, one stdio and one http server', () => {
  const { mcpServers } = JSON.parse(MCP_EXAMPLE);
  assert.equal(typeof mcpServers.files.command, 'string');
  assert.ok(Array.isArray(mcpServers.files.args));
  assert.equal(mcpServers.web.type, 'http');
  assert.match(mcpServers.web.url, /^https:\/\//);
});
