// The Tools screen's logic, pure: skills, tasks, MCP servers and client connections
// (docs/agent.md). Lists kept up to date from `task` and `mcp` events, schedules read
// from and written to the form, and the sentences a person reads about each.

/** A `task` event (the whole task, `deleted` when removed) upserted, newest first. */
export function applyTask(list, data) {
  const rest = list.filter((t) => t.id !== data.id);
  if (data.deleted) return rest;
  const { deleted: _gone, ...task } = data;
  return [...rest, task].sort((a, b) => (b.created || 0) - (a.created || 0));
}

/** An `mcp` event (one server's entry) replacing that server's entry, in place. */
export function applyMcp(list, entry) {
  const i = list.findIndex((s) => s.name === entry.name);
  if (i < 0) return [...list, entry];
  const out = list.slice();
  out[i] = entry;
  return out;
}

const UNITS = [[86400, 'day'], [3600, 'hour'], [60, 'minute']];

function count(n, unit) {
  return n === 1 ? `${unit}` : `${n} ${unit}s`;
}

/** A schedule in words: `{cron}`, `{every_s}` or null. */
export function scheduleText(schedule) {
  if (!schedule) return 'On demand only';
  if (schedule.cron) return `Cron ${schedule.cron}`;
  const s = schedule.every_s;
  for (const [size, unit] of UNITS) {
    if (s % size === 0) return `Every ${count(s / size, unit)}`;
  }
  return `Every ${count(s, 'second')}`;
}

/** The form's fields for a schedule: kind `none`, `every` (minutes) or `cron`. */
export function scheduleToForm(schedule) {
  if (!schedule) return { kind: 'none', value: '' };
  if (schedule.cron) return { kind: 'cron', value: schedule.cron };
  return { kind: 'every', value: String(Math.max(1, Math.round(schedule.every_s / 60))) };
}

/** The schedule a form asks for, or `{error}` in words (the server checks again). */
export function scheduleFromForm(kind, value) {
  const v = String(value || '').trim();
  if (kind === 'none') return { schedule: null };
  if (kind === 'every') {
    if (!/^\d+$/.test(v) || Number(v) < 1) return { error: 'The interval is a whole number of minutes, 1 or more.' };
    return { schedule: { every_s: Number(v) * 60 } };
  }
  if (kind === 'cron') {
    const fields = v.split(/\s+/).filter(Boolean);
    if (fields.length !== 5) return { error: 'A cron line has five fields: minute, hour, day of month, month, day of week (e.g. 0 9 * * 1-5).' };
    return { schedule: { cron: fields.join(' ') } };
  }
  return { error: 'Choose when the task runs.' };
}

/** A wall-clock time (seconds) relative to `now`: "in 5 min", "3 h ago", "just now". */
export function whenText(t, now = Date.now() / 1000) {
  if (t === null || t === undefined) return '';
  const d = t - now;
  const a = Math.abs(d);
  if (a < 45) return d >= 0 ? 'in a moment' : 'just now';
  let text;
  if (a < 3600) text = `${Math.round(a / 60)} min`;
  else if (a < 86400 * 2) text = `${Math.round(a / 3600)} h`;
  else text = `${Math.round(a / 86400)} days`;
  return d > 0 ? `in ${text}` : `${text} ago`;
}

export const RUN_STATE_TEXT = { running: 'running', done: 'done', error: 'failed' };

/** A task's last run in words, or '' when it never ran. */
export function lastRunText(task, now) {
  const last = task.last_run;
  if (!last) return '';
  const state = RUN_STATE_TEXT[last.state] || last.state;
  const when = whenText(last.at, now);
  return `${state}, ${when}${last.state === 'error' && last.error ? `: ${last.error}` : ''}`;
}

/** The next run in words: a time, "paused", or nothing for an on-demand task. */
export function nextRunText(task, now) {
  if (!task.enabled) return 'paused';
  if (task.next_run === null || task.next_run === undefined) return '';
  return whenText(task.next_run, now);
}

/** The person's own skills and the bundled ones, each sorted by name. */
export function skillGroups(skills) {
  const byName = (a, b) => a.name.localeCompare(b.name);
  return {
    own: skills.filter((s) => s.source === 'person').sort(byName),
    bundled: skills.filter((s) => s.source !== 'person').sort(byName),
  };
}

/** A conversation's skill list with `name` switched on or off (order kept, no repeats). */
export function toggleSkill(names, name, on) {
  const rest = (names || []).filter((n) => n !== name);
  return on ? [...rest, name] : rest;
}

/** What POST /api/connect/<id> did, in a sentence. */
export function connectText(name, result) {
  if (!result.changed) return `${name} already uses this server: ${result.settings} is unchanged.`;
  const kept = result.backup ? ` The previous file is kept as ${result.backup}.` : '';
  const note = result.note ? ` ${result.note}` : '';
  return `${name} now uses this server: wrote ${result.settings}.${kept}${note}`;
}

export const MCP_STATE_TEXT = {
  stopped: 'stopped (starts when the agent needs it)',
  starting: 'starting…',
  running: 'running',
  failed: 'failed',
};

/** The example a person copies into <data>/mcp.json. */
export const MCP_EXAMPLE = `{
  "mcpServers": {
    "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/path/to/folder"]},
    "web": {"type": "http", "url": "https://example.com/mcp", "headers": {"Authorization": "Bearer …"}}
  }
}`;
