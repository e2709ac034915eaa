// The Tools screen (docs/agent.md): what the agent may use and who else uses this
// server. Four sections: skills (the person's own created, edited and deleted; the
// bundled ones listed), tasks (schedule, next and last run, run now, live from `task`
// events), MCP servers (state, error, tools, restart, live from `mcp` events) and
// connecting another coding agent (POST /api/connect/<client>). The logic is in
// toolsmodel.js; every error shown is the server's sentence.

import { h, byId, fill } from './dom.js';
import { MODE_TEXT } from './agentmodel.js';
import {
  applyTask, applyMcp, scheduleText, scheduleToForm, scheduleFromForm, lastRunText, nextRunText,
  skillGroups, connectText, MCP_STATE_TEXT, MCP_EXAMPLE, RUN_STATE_TEXT,
} from './toolsmodel.js';

const SECTIONS = [['skills', 'Skills'], ['tasks', 'Tasks'], ['mcp', 'MCP servers'], ['clients', 'Connect a client']];

export class ToolsView {
  /** @param {{api: import('./api.js').Api, openConversation: (id: string) => void, onSkills: (skills: any[]) => void}} opts */
  constructor({ api, openConversation, onSkills }) {
    this.api = api;
    this.openConversation = openConversation;
    this.onSkills = onSkills;
    this.root = byId('view-tools');
    this.skills = [];
    this.tasks = [];
    this.mcp = [];
    this.mcpError = null;
    this.hasTools = true;
    this.clients = [];
    this.workspaces = [];
    this.providers = [];
    this.connectNotes = {};
    this.editingSkill = null;
    this.editingTask = null;
    this.build();
    // "in 5 min" and "3 h ago" kept true while the screen is open, without rebuilding it
    setInterval(() => { if (!this.root.hidden) this.refreshTimes(); }, 30000);
  }

  build() {
    const nav = h('nav', { class: 'tools-nav', 'aria-label': 'Sections' },
      SECTIONS.map(([key, label]) => h('button', { type: 'button', class: 'link-button', text: label, on: { click: () => this.jump(key) } })));
    fill(this.root, h('h2', { class: 'view-title', text: 'Tools' }), nav,
      this.buildSkills(), this.buildTasks(), this.buildMcp(), this.buildClients());
  }

  section(key, title, help, ...children) {
    return h('section', { class: 'tools-section', id: `tools-${key}`, 'aria-labelledby': `tools-${key}-title` },
      h('h3', { class: 'tools-title', id: `tools-${key}-title`, tabindex: '-1', text: title }),
      h('p', { class: 'tools-help', text: help }), ...children);
  }

  jump(key) {
    const title = byId(`tools-${key}-title`);
    title.scrollIntoView({ block: 'start' });
    title.focus();
  }

  async start() {
    await Promise.all([this.loadSkills(), this.loadTasks(), this.loadAgent(), this.loadClients(), this.loadChoices()]);
  }

  /** The screen shown: listings that have no events (skills, clients) read again. */
  async open() {
    await Promise.all([this.loadSkills(), this.loadClients(), this.loadAgent(), this.loadChoices()]);
  }

  /** After the event stream reconnects: what events would have said, read whole. */
  async resync() {
    await Promise.all([this.loadTasks(), this.loadAgent()]);
  }

  onEvent(name, data) {
    if (name === 'task') {
      this.tasks = applyTask(this.tasks, data);
      this.renderTasks();
    } else if (name === 'mcp') {
      this.mcp = applyMcp(this.mcp, data);
      this.renderMcp();
    }
  }

  // -- skills -----------------------------------------------------------------------------

  buildSkills() {
    this.skillList = h('ul', { class: 'tools-list', id: 'skill-list', 'aria-label': 'Skills' });
    this.skillName = h('input', { type: 'text', id: 'skill-name', spellcheck: 'false', placeholder: 'e.g. release-notes' });
    this.skillDesc = h('input', { type: 'text', id: 'skill-description', placeholder: 'One line: when the agent should use it' });
    this.skillBody = h('textarea', { id: 'skill-body', rows: 8, spellcheck: 'false' });
    this.skillError = h('p', { class: 'error', id: 'skill-error', role: 'alert', hidden: true });
    this.skillFormTitle = h('h4', { class: 'panel-sub', text: 'New skill' });
    this.skillSave = h('button', { type: 'button', class: 'primary', id: 'skill-save', text: 'Create skill', on: { click: () => this.saveSkill() } });
    this.skillCancel = h('button', { type: 'button', id: 'skill-cancel', text: 'Cancel', hidden: true, on: { click: () => this.editSkill(null) } });
    const form = h('div', { class: 'tools-form', id: 'skill-form' }, this.skillFormTitle,
      h('label', { for: 'skill-name', class: 'field-label', text: 'Name' }), this.skillName,
      h('label', { for: 'skill-description', class: 'field-label', text: 'Description' }), this.skillDesc,
      h('label', { for: 'skill-body', class: 'field-label', text: 'Instructions (the body of SKILL.md, Markdown)' }), this.skillBody,
      this.skillError, h('div', { class: 'composer-bar' }, h('div', { class: 'spacer' }), this.skillCancel, this.skillSave));
    this.editSkill(null);
    return this.section('skills', 'Skills',
      'Instructions the agent reads when a conversation switches them on (on the Agent screen, in the open conversation\'s Skills). Bundled skills come with bmoe; yours live in the data folder and hide a bundled one of the same name.',
      this.skillList, form);
  }

  async loadSkills() {
    try {
      this.skills = (await this.api.get('/api/skills')).skills;
    } catch (e) {
      this.skills = [];
      this.showSkillError(e.message);
    }
    this.renderSkills();
    this.onSkills(this.skills);
  }

  renderSkills() {
    const { own, bundled } = skillGroups(this.skills);
    const row = (s) => h('li', { class: 'tools-item', dataset: { skill: s.name, source: s.source } },
      h('div', { class: 'tools-item-head' },
        h('code', { class: 'tools-name', text: s.name }),
        h('span', { class: 'agent-badge', text: s.source === 'person' ? 'yours' : 'bundled' }),
        h('div', { class: 'spacer' }),
        s.source === 'person' ? h('button', { type: 'button', text: 'Edit', 'aria-label': `Edit ${s.name}`, on: { click: () => this.editSkill(s) } }) : null,
        s.source === 'person' ? h('button', { type: 'button', class: 'danger', text: 'Delete', 'aria-label': `Delete ${s.name}`, on: { click: () => this.deleteSkill(s.name) } }) : null),
      h('p', { class: 'tools-desc', text: s.description }));
    fill(this.skillList, [...own, ...bundled].map(row),
      this.skills.length ? null : h('li', { class: 'tools-empty', text: 'No skills yet: create one below.' }));
  }

  editSkill(skill) {
    this.editingSkill = skill;
    this.skillName.value = skill ? skill.name : '';
    this.skillName.disabled = Boolean(skill);
    this.skillDesc.value = skill ? skill.description : '';
    this.skillBody.value = '';
    this.skillBody.placeholder = skill ? 'Leave empty to keep the instructions as they are.' : 'What the agent should do, step by step.';
    this.skillFormTitle.textContent = skill ? `Edit ${skill.name}` : 'New skill';
    this.skillSave.textContent = skill ? 'Save changes' : 'Create skill';
    this.skillCancel.hidden = !skill;
    this.skillError.hidden = true;
    if (skill) {
      this.skillDesc.focus();
      this.loadSkillBody(skill);
    }
  }

  // The instructions of the skill being edited, into the box (the list carries none).
  async loadSkillBody(skill) {
    try {
      const detail = await this.api.json('GET', `/api/skills/${encodeURIComponent(skill.name)}`);
      if (this.editingSkill === skill && !this.skillBody.value) this.skillBody.value = detail.body || '';
    } catch (e) {
      if (this.editingSkill === skill) this.showSkillError(e.message);
    }
  }

  async saveSkill() {
    const description = this.skillDesc.value;
    const body = this.skillBody.value;
    try {
      if (this.editingSkill) {
        const change = { description };
        if (body.trim()) change.body = body;
        await this.api.json('PUT', `/api/skills/${encodeURIComponent(this.editingSkill.name)}`, change);
      } else {
        await this.api.json('POST', '/api/skills', { name: this.skillName.value.trim(), description, body });
      }
      this.editSkill(null);
      await this.loadSkills();
    } catch (e) {
      this.showSkillError(e.message);
    }
  }

  async deleteSkill(name) {
    try {
      await this.api.json('DELETE', `/api/skills/${encodeURIComponent(name)}`, {});
      if (this.editingSkill && this.editingSkill.name === name) this.editSkill(null);
      await this.loadSkills();
    } catch (e) {
      this.showSkillError(e.message);
    }
  }

  showSkillError(message) {
    this.skillError.textContent = message;
    this.skillError.hidden = false;
  }

  // -- tasks ------------------------------------------------------------------------------

  buildTasks() {
    this.taskList = h('ul', { class: 'tools-list', id: 'task-list', 'aria-label': 'Tasks' });
    this.taskListError = h('p', { class: 'error', id: 'task-list-error', role: 'alert', hidden: true });
    const f = {
      title: h('input', { type: 'text', id: 'task-title', placeholder: 'e.g. Morning check' }),
      prompt: h('textarea', { id: 'task-prompt', rows: 4, placeholder: 'What the agent is asked each time the task runs.' }),
      workspace: h('select', { id: 'task-workspace' }),
      mode: h('select', { id: 'task-mode' }, Object.entries(MODE_TEXT).map(([v, t]) => h('option', { value: v, text: t }))),
      route: h('select', { id: 'task-route' }),
      kind: h('select', { id: 'task-schedule-kind', 'aria-label': 'When it runs' },
        h('option', { value: 'none', text: 'Only when I run it' }),
        h('option', { value: 'every', text: 'Every N minutes' }),
        h('option', { value: 'cron', text: 'On a cron schedule' })),
      value: h('input', { type: 'text', id: 'task-schedule-value', 'aria-label': 'Minutes or cron line', spellcheck: 'false' }),
      enabled: h('input', { type: 'checkbox', id: 'task-enabled', checked: true }),
    };
    f.kind.addEventListener('change', () => this.renderScheduleValue());
    this.taskForm = f;
    this.taskFormTitle = h('h4', { class: 'panel-sub', text: 'New task' });
    this.taskError = h('p', { class: 'error', id: 'task-error', role: 'alert', hidden: true });
    this.taskSave = h('button', { type: 'button', class: 'primary', id: 'task-save', text: 'Create task', on: { click: () => this.saveTask() } });
    this.taskCancel = h('button', { type: 'button', id: 'task-cancel', text: 'Cancel', hidden: true, on: { click: () => this.editTask(null) } });
    this.noWorkspace = h('p', { class: 'note', text: 'A task runs in a workspace folder: add one on the Agent screen first.', hidden: true });
    const form = h('div', { class: 'tools-form', id: 'task-form' }, this.taskFormTitle,
      h('label', { for: 'task-title', class: 'field-label', text: 'Title' }), f.title,
      h('label', { for: 'task-prompt', class: 'field-label', text: 'Prompt' }), f.prompt,
      h('div', { class: 'tools-row' },
        h('div', {}, h('label', { for: 'task-workspace', class: 'field-label', text: 'Workspace' }), f.workspace),
        h('div', {}, h('label', { for: 'task-mode', class: 'field-label', text: 'Access' }), f.mode),
        h('div', {}, h('label', { for: 'task-route', class: 'field-label', text: 'Model' }), f.route)),
      this.noWorkspace,
      h('label', { for: 'task-schedule-kind', class: 'field-label', text: 'When it runs' }),
      h('div', { class: 'tools-row' }, f.kind, f.value),
      h('label', { class: 'toggle' }, f.enabled, ' Scheduled runs on'),
      this.taskError, h('div', { class: 'composer-bar' }, h('div', { class: 'spacer' }), this.taskCancel, this.taskSave));
    this.editTask(null);
    return this.section('tasks', 'Tasks',
      'Saved prompts the agent runs in a workspace on a schedule or when you say so. Each run is a new conversation; a run missed while the server was down happens once when it starts.',
      this.taskListError, this.taskList, form);
  }

  renderScheduleValue() {
    const kind = this.taskForm.kind.value;
    const v = this.taskForm.value;
    v.hidden = kind === 'none';
    v.placeholder = kind === 'cron' ? '0 9 * * 1-5 (minute hour day month weekday)' : 'minutes, e.g. 60';
  }

  async loadTasks() {
    try {
      this.tasks = (await this.api.get('/api/tasks')).tasks;
      this.taskListError.hidden = true;
    } catch (e) {
      this.tasks = [];
      this.taskListError.textContent = e.message;
      this.taskListError.hidden = false;
    }
    this.renderTasks();
  }

  /** The workspaces and saved providers a task may name. */
  async loadChoices() {
    const [ws, pv] = await Promise.all([
      this.api.get('/api/workspaces').catch(() => ({ workspaces: [] })),
      this.api.get('/api/providers').catch(() => ({ providers: [] })),
    ]);
    this.workspaces = ws.workspaces;
    this.providers = pv.providers;
    const f = this.taskForm;
    const keep = (sel, values) => (values.includes(sel.value) ? sel.value : null);
    const w = keep(f.workspace, this.workspaces.map((x) => x.id));
    fill(f.workspace, this.workspaces.length ? null : h('option', { value: '', text: 'No workspace yet' }),
      this.workspaces.map((x) => h('option', { value: x.id, text: x.path })));
    if (w) f.workspace.value = w;
    const r = keep(f.route, this.providers.map((p) => p.id));
    fill(f.route, h('option', { value: 'local', text: 'The local model' }),
      this.providers.map((p) => h('option', { value: p.id, text: `${p.id} (${p.model})` })));
    if (r) f.route.value = r;
    this.noWorkspace.hidden = this.workspaces.length > 0;
    this.renderTasks();
  }

  renderTasks() {
    const now = Date.now() / 1000;
    const wsPath = (id) => (this.workspaces.find((w) => w.id === id) || {}).path || 'a removed folder';
    fill(this.taskList, this.tasks.map((t) => {
      const last = t.last_run;
      const next = nextRunText(t, now);
      return h('li', { class: 'tools-item', dataset: { task: t.id, run: last ? last.state : '' } },
        h('div', { class: 'tools-item-head' },
          h('strong', { class: 'tools-name', text: t.title }),
          h('span', { class: 'agent-badge', text: scheduleText(t.schedule) }),
          last ? h('span', { class: `agent-badge state-${last.state}`, text: RUN_STATE_TEXT[last.state] || last.state }) : null,
          h('div', { class: 'spacer' }),
          h('button', { type: 'button', class: 'primary', text: 'Run now', dataset: { action: 'run' }, 'aria-label': `Run ${t.title} now`, on: { click: () => this.runTask(t) } }),
          h('button', { type: 'button', text: 'Edit', 'aria-label': `Edit ${t.title}`, on: { click: () => this.editTask(t) } }),
          h('button', { type: 'button', class: 'danger', text: 'Delete', 'aria-label': `Delete ${t.title}`, on: { click: () => this.deleteTask(t) } })),
        h('p', { class: 'tools-desc', text: `${MODE_TEXT[t.mode] || t.mode} in ${wsPath(t.workspace)}${t.route && t.route !== 'local' ? `, with ${t.route}` : ''}` }),
        h('dl', { class: 'tools-runs' },
          next ? [h('dt', { text: 'Next run' }), h('dd', { class: 'task-next', text: next })] : null,
          h('dt', { text: 'Last run' }),
          h('dd', { class: 'task-last' }, h('span', { class: 'task-last-text', text: last ? lastRunText(t, now) : 'never' }),
            last && last.conversation ? [' · ', h('a', {
              href: '#agent', class: 'task-conv',
              on: { click: (e) => { e.preventDefault(); this.openConversation(last.conversation); } },
            }, 'open its conversation')] : null)),
        h('p', { class: 'error', role: 'alert', dataset: { for: t.id }, hidden: true }));
    }), this.tasks.length ? null : h('li', { class: 'tools-empty', text: 'No tasks yet.' }));
  }

  refreshTimes(now = Date.now() / 1000) {
    for (const t of this.tasks) {
      const li = [...this.taskList.children].find((el) => el.dataset.task === t.id);
      if (!li) continue;
      const next = li.querySelector('.task-next');
      if (next) next.textContent = nextRunText(t, now);
      const last = li.querySelector('.task-last-text');
      if (last && t.last_run) last.textContent = lastRunText(t, now);
    }
  }

  editTask(task) {
    this.editingTask = task;
    const f = this.taskForm;
    f.title.value = task ? task.title : '';
    f.prompt.value = task ? task.prompt : '';
    if (task && task.workspace) f.workspace.value = task.workspace;
    f.mode.value = task ? task.mode : 'ask';
    f.route.value = task ? task.route || 'local' : 'local';
    const sched = scheduleToForm(task ? task.schedule : null);
    f.kind.value = sched.kind;
    f.value.value = sched.value;
    f.enabled.checked = task ? task.enabled : true;
    this.renderScheduleValue();
    this.taskFormTitle.textContent = task ? `Edit ${task.title}` : 'New task';
    this.taskSave.textContent = task ? 'Save changes' : 'Create task';
    this.taskCancel.hidden = !task;
    this.taskError.hidden = true;
    if (task) f.title.focus();
  }

  async saveTask() {
    const f = this.taskForm;
    const sched = scheduleFromForm(f.kind.value, f.value.value);
    if (sched.error) {
      this.showTaskError(sched.error);
      return;
    }
    const body = {
      title: f.title.value, prompt: f.prompt.value, workspace: f.workspace.value, mode: f.mode.value,
      route: f.route.value || 'local', schedule: sched.schedule, enabled: f.enabled.checked,
    };
    try {
      const t = this.editingTask
        ? await this.api.json('PUT', `/api/tasks/${encodeURIComponent(this.editingTask.id)}`, body)
        : await this.api.json('POST', '/api/tasks', body);
      this.tasks = applyTask(this.tasks, t);
      this.editTask(null);
      this.renderTasks();
    } catch (e) {
      this.showTaskError(e.message);
    }
  }

  async runTask(task) {
    try {
      const { task: t } = await this.api.json('POST', `/api/tasks/${encodeURIComponent(task.id)}/run`, {});
      this.tasks = applyTask(this.tasks, t);
      this.renderTasks();
    } catch (e) {
      this.taskItemError(task.id, e.message);
    }
  }

  async deleteTask(task) {
    try {
      await this.api.json('DELETE', `/api/tasks/${encodeURIComponent(task.id)}`, {});
      this.tasks = applyTask(this.tasks, { id: task.id, deleted: true });
      if (this.editingTask && this.editingTask.id === task.id) this.editTask(null);
      this.renderTasks();
    } catch (e) {
      this.taskItemError(task.id, e.message);
    }
  }

  taskItemError(id, message) {
    const el = [...this.taskList.querySelectorAll('p.error')].find((p) => p.dataset.for === id);
    if (!el) return;
    el.textContent = message;
    el.hidden = false;
  }

  showTaskError(message) {
    this.taskError.textContent = message;
    this.taskError.hidden = false;
  }

  // -- MCP servers ----------------------------------------------------------------------

  buildMcp() {
    this.mcpList = h('ul', { class: 'tools-list', id: 'mcp-list', 'aria-label': 'MCP servers' });
    this.mcpNote = h('div', { class: 'tools-mcp-help', id: 'mcp-help' });
    return this.section('mcp', 'MCP servers',
      'Programs that give the agent more tools, in the mcpServers format Claude Desktop and Claude Code read. A server starts when first needed and is started again after a failure.',
      this.mcpList, this.mcpNote);
  }

  async loadAgent() {
    try {
      const caps = await this.api.get('/api/agent');
      this.hasTools = caps.tools;
      this.mcp = caps.mcp || [];
      this.mcpError = caps.mcp_error || null;
    } catch {
      this.hasTools = false;
      this.mcp = [];
    }
    this.renderMcp();
  }

  renderMcp() {
    fill(this.mcpList, this.mcp.map((s) => h('li', { class: 'tools-item', dataset: { mcp: s.name, state: s.state } },
      h('div', { class: 'tools-item-head' },
        h('code', { class: 'tools-name', text: s.name }),
        h('span', { class: 'agent-badge', text: s.transport }),
        h('span', { class: `agent-badge mcp-state state-${s.state === 'failed' ? 'error' : s.state}`, text: MCP_STATE_TEXT[s.state] || s.state }),
        s.restarts ? h('span', { class: 'tools-muted', text: `restarted ${s.restarts} ${s.restarts === 1 ? 'time' : 'times'}` }) : null,
        h('div', { class: 'spacer' }),
        h('button', { type: 'button', text: 'Restart', 'aria-label': `Restart ${s.name}`, on: { click: () => this.restartMcp(s.name) } })),
      s.error ? h('p', { class: 'error mcp-error', text: s.error }) : null,
      s.tools.length
        ? h('ul', { class: 'tools-mcp-tools', 'aria-label': `${s.name}'s tools` }, s.tools.map((t) => h('li', {},
          h('code', { text: t.name }), t.description ? h('span', { class: 'tools-muted', text: ` ${t.description}` }) : null)))
        : h('p', { class: 'tools-muted', text: s.state === 'running' ? 'It offers no tools.' : 'Its tools are listed once it runs.' }),
      h('p', { class: 'error', role: 'alert', dataset: { for: s.name }, hidden: true }))));
    const help = [];
    if (!this.hasTools) help.push(h('p', { class: 'note', text: 'This server runs conversations as plain chat (or you are not on its machine): the agent uses no MCP servers here.' }));
    if (this.mcpError) help.push(h('p', { class: 'error', text: this.mcpError }));
    if (this.hasTools && !this.mcp.length) {
      help.push(h('p', {}, 'No MCP servers are configured. Write them in ', h('code', { text: 'mcp.json' }),
        ' in the server\'s data folder (or the file --mcp-servers-config names) and start the server again, for example:'),
      h('pre', { class: 'tools-example', text: MCP_EXAMPLE }));
    }
    fill(this.mcpNote, help);
  }

  async restartMcp(name) {
    try {
      this.mcp = applyMcp(this.mcp, await this.api.json('POST', `/api/mcp/${encodeURIComponent(name)}/restart`, {}));
      this.renderMcp();
    } catch (e) {
      const el = [...this.mcpList.querySelectorAll('p.error[role=alert]')].find((p) => p.dataset.for === name);
      if (el) {
        el.textContent = e.message;
        el.hidden = false;
      }
    }
  }

  // -- clients ----------------------------------------------------------------------------

  buildClients() {
    this.clientList = h('ul', { class: 'tools-list', id: 'client-list', 'aria-label': 'Coding agents' });
    this.clientError = h('p', { class: 'error', role: 'alert', hidden: true });
    return this.section('clients', 'Connect a client',
      'Other coding agents on this computer can use this server\'s model. Connect writes that program\'s own settings file (merged into what is there, the old file kept as a backup beside it); a file that cannot be read safely is left as it is.',
      this.clientError, this.clientList);
  }

  async loadClients() {
    try {
      this.clients = (await this.api.get('/api/clients')).clients;
      this.clientError.hidden = true;
    } catch (e) {
      this.clients = [];
      this.clientError.textContent = e.message;
      this.clientError.hidden = false;
    }
    this.renderClients();
  }

  renderClients() {
    fill(this.clientList, this.clients.map((c) => {
      const note = this.connectNotes[c.id];
      return h('li', { class: 'tools-item', dataset: { client: c.id } },
        h('div', { class: 'tools-item-head' },
          h('strong', { class: 'tools-name', text: c.name }),
          h('span', { class: ['agent-badge', c.installed ? 'tool-done' : ''], text: c.installed ? 'installed' : 'not installed' }),
          c.connected ? h('span', { class: 'agent-badge state-running', text: 'connected' }) : null,
          h('div', { class: 'spacer' }),
          h('button', { type: 'button', class: 'primary', id: `connect-${c.id}`, text: c.connected ? 'Connect again' : 'Connect', on: { click: () => this.connect(c) } })),
        h('p', { class: 'tools-desc' }, 'Settings: ', h('code', { text: c.settings })),
        note ? h('p', { class: note.error ? 'error client-result' : 'client-result', role: note.error ? 'alert' : 'status', text: note.text }) : null);
    }));
  }

  async connect(client) {
    try {
      const result = await this.api.json('POST', `/api/connect/${encodeURIComponent(client.id)}`, {});
      this.connectNotes[client.id] = { text: connectText(client.name, result), error: false };
    } catch (e) {
      this.connectNotes[client.id] = { text: e.message, error: true };
    }
    await this.loadClients();
  }
}
