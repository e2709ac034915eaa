// The Agent screen: conversations with the built-in agent (docs/agent.md).
//
// Left, the conversation list and "New conversation" (a workspace folder and an
// access mode); right, the open conversation's items as they stream (reasoning
// folded, tool calls with their arguments as they are written, approval cards for
// calls that wait), stop, edit-and-rerun of a message, and the preview of a page the
// agent wrote in a sandboxed frame. Everything is built with createElement (the CSP
// allows no inline style or script); model text goes through the sanitiser.

import { h, byId, fill, frameThrottle } from './dom.js';
import {
  applyConversation, applyItem, applyDelta, argumentsText, previewPath, TOOL_STATE_TEXT, MODE_TEXT,
} from './agentmodel.js';
import { toggleSkill } from './toolsmodel.js';

export class AgentView {
  constructor({ api, renderer }) {
    this.api = api;
    this.renderer = renderer;
    this.root = byId('view-agent');
    this.list = [];
    this.conv = null;
    this.workspaces = [];
    this.skills = [];
    this.caps = { tools: true };
    this.itemEls = new Map();
    this.dirty = new Set();
    this.flush = frameThrottle(() => this.renderDirty());
    this.build();
  }

  build() {
    this.listEl = h('ul', { class: 'agent-list', 'aria-label': 'Conversations' });
    this.wsSelect = h('select', { 'aria-label': 'Workspace' });
    this.modeSelect = h('select', { 'aria-label': 'Access mode' },
      Object.entries(MODE_TEXT).map(([v, t]) => h('option', { value: v, text: t })));
    this.modeSelect.value = 'ask';
    this.folderInput = h('input', { type: 'text', placeholder: '/absolute/path/to/a/folder', 'aria-label': 'Folder to add', spellcheck: 'false' });
    this.newError = h('p', { class: 'error', role: 'alert', hidden: true });
    this.wsBox = h('div', { class: 'agent-ws' },
      h('label', { class: 'field-label', text: 'Workspace' }), this.wsSelect,
      h('div', { class: 'agent-add-folder' }, this.folderInput,
        h('button', { type: 'button', text: 'Add folder', on: { click: () => this.addFolder() } })),
      h('label', { class: 'field-label', text: 'Access' }), this.modeSelect);
    this.routeSelect = h('select', { 'aria-label': 'Model', id: 'agent-route' });
    this.providerList = h('ul', { class: 'agent-providers' });
    this.providerForm = this.buildProviderForm();
    this.routeBox = h('div', { class: 'agent-ws' },
      h('label', { class: 'field-label', text: 'Model' }), this.routeSelect,
      h('details', { class: 'agent-provider-box' }, h('summary', { text: 'Remote models' }),
        this.providerList, this.providerForm));
    const side = h('aside', { class: 'agent-side' },
      h('button', { type: 'button', class: 'primary', id: 'agent-new', text: 'New conversation', on: { click: () => this.create() } }),
      this.wsBox, this.routeBox, this.newError, this.listEl);
    this.titleEl = h('h2', { class: 'agent-title', text: 'No conversation open' });
    this.metaEl = h('div', { class: 'agent-meta' });
    this.stopButton = h('button', { type: 'button', class: 'danger', id: 'agent-stop', text: 'Stop', hidden: true, on: { click: () => this.stop() } });
    this.deleteButton = h('button', { type: 'button', text: 'Delete', hidden: true, on: { click: () => this.remove() } });
    this.skillsBox = h('details', { class: 'agent-skills', id: 'agent-skills', hidden: true });
    this.itemsEl = h('div', { class: 'agent-items', 'aria-live': 'polite' });
    this.input = h('textarea', { rows: 3, id: 'agent-prompt', 'aria-label': 'Message to the agent', placeholder: 'Ask the agent. Enter sends; Shift+Enter starts a new line.' });
    this.input.addEventListener('keydown', (e) => {
      if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.send();
      }
    });
    this.sendButton = h('button', { type: 'button', class: 'primary', id: 'agent-send', text: 'Send', on: { click: () => this.send() } });
    this.errorEl = h('p', { class: 'error', role: 'alert', hidden: true });
    this.previewFrame = null;
    this.previewBox = h('div', { class: 'agent-preview', hidden: true });
    const main = h('div', { class: 'agent-main' },
      h('div', { class: 'agent-head' }, this.titleEl, this.metaEl, h('div', { class: 'spacer' }), this.deleteButton, this.stopButton),
      this.skillsBox, this.itemsEl, this.previewBox, this.errorEl,
      h('div', { class: 'composer' }, this.input, h('div', { class: 'composer-bar' }, h('div', { class: 'spacer' }), this.sendButton)));
    fill(this.root, h('div', { class: 'agent' }, side, main));
    this.renderHead();
  }

  async start() {
    try {
      this.caps = await this.api.get('/api/agent');
    } catch {
      this.caps = { tools: false };
    }
    this.wsBox.hidden = !this.caps.tools;
    this.renderSkills();
    await Promise.all([this.loadList(), this.loadWorkspaces(), this.loadProviders()]);
  }

  /** After the event stream reconnects: the list and the open conversation, whole. */
  async resync() {
    await this.loadList();
    if (this.conv) await this.open(this.conv.id);
  }

  async loadList() {
    try {
      const { conversations } = await this.api.get('/api/conversations');
      this.list = conversations;
      this.renderList();
    } catch (e) {
      this.showError(e.message);
    }
  }

  async loadWorkspaces() {
    if (!this.caps.tools) return;
    try {
      this.workspaces = (await this.api.get('/api/workspaces')).workspaces;
    } catch {
      this.workspaces = []; // not on this machine: the network gets none
    }
    const current = this.wsSelect.value;
    fill(this.wsSelect, h('option', { value: '', text: 'No folder (chat only)' }),
      this.workspaces.map((w) => h('option', { value: w.id, text: w.path })));
    if (this.workspaces.some((w) => w.id === current)) this.wsSelect.value = current;
  }

  buildProviderForm() {
    const f = {
      id: h('input', { type: 'text', placeholder: 'name, e.g. openai', 'aria-label': 'Provider name', spellcheck: 'false' }),
      kind: h('select', { 'aria-label': 'Provider kind' }, h('option', { value: 'openai', text: 'OpenAI-compatible' }), h('option', { value: 'anthropic', text: 'Anthropic Messages' })),
      url: h('input', { type: 'text', placeholder: 'https://api.example.com/v1', 'aria-label': 'Base URL', spellcheck: 'false' }),
      model: h('input', { type: 'text', placeholder: 'model name', 'aria-label': 'Model name', spellcheck: 'false' }),
      key: h('input', { type: 'password', placeholder: 'API key (kept on this machine)', 'aria-label': 'API key', autocomplete: 'off' }),
    };
    const save = async () => {
      const body = { kind: f.kind.value, base_url: f.url.value.trim(), model: f.model.value.trim() };
      if (f.key.value) body.api_key = f.key.value;
      try {
        await this.api.json('PUT', `/api/providers/${encodeURIComponent(f.id.value.trim())}`, body);
        f.key.value = '';
        this.newError.hidden = true;
        await this.loadProviders();
      } catch (e) {
        this.newError.textContent = e.message;
        this.newError.hidden = false;
      }
    };
    return h('div', { class: 'agent-provider-form' }, f.id, f.kind, f.url, f.model, f.key,
      h('button', { type: 'button', text: 'Save remote model', on: { click: save } }));
  }

  async loadProviders() {
    let providers = [];
    try {
      providers = (await this.api.get('/api/providers')).providers;
    } catch {
      providers = []; // not on this machine
    }
    const current = this.routeSelect.value;
    fill(this.routeSelect, h('option', { value: 'local', text: 'The local model' }),
      providers.map((p) => h('option', { value: p.id, text: `${p.id} (${p.model})` })));
    if (providers.some((p) => p.id === current)) this.routeSelect.value = current;
    fill(this.providerList, providers.map((p) => h('li', {},
      h('span', { text: `${p.id}: ${p.kind}, ${p.model}${p.has_key ? ', key saved' : ''}` }),
      h('button', { type: 'button', class: 'link-button', text: 'Remove', on: { click: () => this.removeProvider(p.id) } }))));
  }

  async removeProvider(id) {
    try {
      await this.api.json('DELETE', `/api/providers/${encodeURIComponent(id)}`, {});
      await this.loadProviders();
    } catch (e) {
      this.newError.textContent = e.message;
      this.newError.hidden = false;
    }
  }

  async addFolder() {
    const path = this.folderInput.value.trim();
    if (!path) return;
    try {
      const w = await this.api.json('POST', '/api/workspaces', { path });
      this.folderInput.value = '';
      this.newError.hidden = true;
      await this.loadWorkspaces();
      this.wsSelect.value = w.id;
    } catch (e) {
      this.newError.textContent = e.message;
      this.newError.hidden = false;
    }
  }

  async create() {
    const body = { mode: this.modeSelect.value };
    if (this.wsSelect.value) body.workspace = this.wsSelect.value;
    if (this.routeSelect.value && this.routeSelect.value !== 'local') body.route = this.routeSelect.value;
    try {
      const conv = await this.api.json('POST', '/api/conversations', body);
      this.newError.hidden = true;
      this.list = applyConversation(this.list, conv);
      this.renderList();
      this.show(conv);
      this.input.focus();
    } catch (e) {
      this.newError.textContent = e.message;
      this.newError.hidden = false;
    }
  }

  async open(id) {
    try {
      this.show(await this.api.get(`/api/conversations/${encodeURIComponent(id)}`));
    } catch (e) {
      this.showError(e.message);
    }
  }

  show(conv) {
    this.conv = conv;
    this.itemEls.clear();
    this.itemsEl.replaceChildren();
    this.closePreview();
    for (const item of conv.items) this.renderItem(item);
    this.renderHead();
    this.renderList();
    this.renderSkills();
    this.errorEl.hidden = true;
  }

  /** The skills there are (the Tools screen reads them), for the open conversation's switches. */
  setSkills(skills) {
    this.skills = skills;
    this.renderSkills();
  }

  renderSkills() {
    const conv = this.conv;
    const box = this.skillsBox;
    box.hidden = !conv || !this.caps.tools || !this.skills.length;
    if (box.hidden) return;
    const on = conv.skills || [];
    const wasOpen = box.open;
    fill(box, h('summary', { text: `Skills (${on.length} on)` }),
      h('div', { class: 'agent-skill-list', role: 'group', 'aria-label': 'Skills for this conversation' },
        conv.workspace ? null : h('p', { class: 'note', text: 'Skills are offered to the agent in a conversation with a workspace folder.' }),
        this.skills.map((s) => h('label', { class: 'toggle', title: s.description },
          h('input', { type: 'checkbox', checked: on.includes(s.name), dataset: { skill: s.name }, on: { change: (e) => this.switchSkill(s.name, e.target.checked) } }),
          ` ${s.name}`))));
    box.open = wasOpen;
  }

  async switchSkill(name, onOff) {
    const conv = this.conv;
    if (!conv) return;
    try {
      const changed = await this.api.json('PUT', `/api/conversations/${conv.id}`, { skills: toggleSkill(conv.skills, name, onOff) });
      if (this.conv === conv) conv.skills = changed.skills;
      this.errorEl.hidden = true;
    } catch (e) {
      this.showError(e.message);
    }
    this.renderSkills();
  }

  // -- events ----------------------------------------------------------------------

  onEvent(name, data) {
    if (name === 'conversation') {
      this.list = applyConversation(this.list, data);
      this.renderList();
      if (this.conv && data.id === this.conv.id) {
        if (data.deleted) {
          this.conv = null;
          this.itemsEl.replaceChildren();
        } else Object.assign(this.conv, { title: data.title, state: data.state, updated: data.updated });
        this.renderHead();
      }
    } else if (name === 'item') {
      const item = applyItem(this.conv, data);
      if (item) this.renderItem(item);
    } else if (name === 'delta') {
      const item = applyDelta(this.conv, data);
      if (item) {
        this.dirty.add(item.id);
        this.flush();
      }
    }
  }

  renderDirty() {
    if (!this.conv) return;
    for (const id of this.dirty) {
      const item = this.conv.items.find((it) => it.id === id);
      if (item) this.renderItem(item);
    }
    this.dirty.clear();
  }

  // -- rendering ---------------------------------------------------------------------

  renderList() {
    fill(this.listEl, this.list.map((c) => h('li', {},
      h('button', {
        type: 'button', class: ['agent-conv', this.conv && c.id === this.conv.id ? 'current' : ''],
        dataset: { id: c.id, state: c.state },
        on: { click: () => this.open(c.id) },
      }, h('span', { class: 'agent-conv-title', text: c.title || 'New conversation' }),
      h('span', { class: `agent-badge state-${c.state}`, text: c.state })))));
  }

  renderHead() {
    const conv = this.conv;
    this.titleEl.textContent = conv ? conv.title : 'No conversation open';
    const running = conv && (conv.state === 'running' || conv.state === 'waiting');
    this.stopButton.hidden = !running;
    this.deleteButton.hidden = !conv || running;
    this.sendButton.disabled = !conv || running;
    this.input.disabled = !conv;
    if (!conv) {
      fill(this.metaEl);
      this.skillsBox.hidden = true;
      return;
    }
    const ws = conv.workspace ? conv.workspace.path : 'no folder';
    fill(this.metaEl, h('span', { class: 'agent-badge', text: MODE_TEXT[conv.mode] || conv.mode }),
      conv.route && conv.route !== 'local' ? h('span', { class: 'agent-badge', text: conv.route }) : null,
      h('span', { class: 'agent-ws-path', text: ws }),
      h('span', { class: `agent-badge state-${conv.state}`, id: 'agent-state', text: conv.state }));
  }

  renderItem(item) {
    const el = this.itemView(item);
    const old = this.itemEls.get(item.id);
    if (old) old.replaceWith(el);
    else this.itemsEl.append(el);
    this.itemEls.set(item.id, el);
    this.itemsEl.scrollTop = this.itemsEl.scrollHeight;
  }

  itemView(item) {
    const box = h('div', { class: `agent-item agent-${item.kind}`, dataset: { id: item.id, kind: item.kind, state: item.state || '' } });
    if (item.kind === 'user') {
      box.append(h('div', { class: 'agent-user-text', text: item.text }),
        h('button', { type: 'button', class: 'link-button agent-edit', text: 'Edit', on: { click: () => this.editMessage(item, box) } }));
    } else if (item.kind === 'assistant') {
      if (!item.text && !item.reasoning) box.classList.add(item.state === 'done' ? 'agent-empty' : 'agent-pending');
      if (item.reasoning) {
        box.append(h('details', { class: 'agent-reasoning' }, h('summary', { text: 'Reasoning' }),
          h('div', { class: 'agent-reasoning-text', text: item.reasoning })));
      }
      const text = h('div', { class: 'agent-text md' });
      if (item.text) text.replaceChildren(this.renderer.render(item.text));
      box.append(text);
    } else if (item.kind === 'tool') {
      box.append(this.toolView(item));
    } else {
      box.classList.add(`notice-${item.state}`);
      box.append(h('span', { text: item.text }));
    }
    return box;
  }

  toolView(item) {
    const out = h('div', { class: 'agent-tool' },
      h('div', { class: 'agent-tool-head' }, h('code', { class: 'agent-tool-name', text: item.name }),
        h('span', { class: `agent-badge tool-${item.state}`, text: TOOL_STATE_TEXT[item.state] || item.state })),
      h('pre', { class: 'agent-args', text: argumentsText(item.arguments) }));
    if (item.state === 'waiting') out.append(this.approvalCard(item));
    if (item.output) {
      out.append(h('details', { class: 'agent-output', open: item.state !== 'done' ? true : null },
        h('summary', { text: item.state === 'denied' ? 'Why' : 'Result' }), h('pre', { text: item.output })));
    }
    const path = previewPath(item);
    if (path) out.append(h('button', { type: 'button', class: 'agent-preview-button', text: `Preview ${path}`, on: { click: () => this.preview(path) } }));
    return out;
  }

  approvalCard(item) {
    const reason = h('input', { type: 'text', class: 'agent-reason', placeholder: 'Reason (optional, the model reads it)', 'aria-label': 'Reason for denying' });
    const answer = (decision) => this.approve(item, decision, reason.value);
    return h('div', { class: 'agent-approval', role: 'group', 'aria-label': 'Approve this call' },
      h('button', { type: 'button', class: 'primary', dataset: { decision: 'once' }, text: 'Allow once', on: { click: () => answer('once') } }),
      h('button', { type: 'button', dataset: { decision: 'always' }, text: 'Allow for this conversation', on: { click: () => answer('always') } }),
      reason,
      h('button', { type: 'button', class: 'danger', dataset: { decision: 'deny' }, text: 'Deny', on: { click: () => answer('deny') } }));
  }

  editMessage(item, box) {
    if (this.conv.state === 'running' || this.conv.state === 'waiting') return;
    const area = h('textarea', { rows: 3, class: 'agent-edit-text', 'aria-label': 'Edit the message' });
    area.value = item.text;
    const save = async () => {
      try {
        await this.api.json('PUT', `/api/conversations/${this.conv.id}/items/${item.id}`, { text: area.value });
        await this.open(this.conv.id);
      } catch (e) {
        this.showError(e.message);
      }
    };
    fill(box, area, h('div', { class: 'composer-bar' },
      h('button', { type: 'button', text: 'Cancel', on: { click: () => this.renderItem(item) } }),
      h('button', { type: 'button', class: 'primary', text: 'Save and run again', on: { click: save } })));
    area.focus();
  }

  // -- actions -------------------------------------------------------------------------

  async send() {
    const text = this.input.value;
    if (!this.conv || !text.trim()) return;
    try {
      const { item } = await this.api.json('POST', `/api/conversations/${this.conv.id}/messages`, { text });
      this.input.value = '';
      this.errorEl.hidden = true;
      if (!this.itemEls.has(item.id)) applyItem(this.conv, { conversation: this.conv.id, item }) && this.renderItem(item);
    } catch (e) {
      this.showError(e.message);
    }
  }

  async stop() {
    if (!this.conv) return;
    try {
      await this.api.json('POST', `/api/conversations/${this.conv.id}/stop`, {});
    } catch (e) {
      this.showError(e.message);
    }
  }

  async remove() {
    if (!this.conv) return;
    try {
      await this.api.json('DELETE', `/api/conversations/${this.conv.id}`, {});
    } catch (e) {
      this.showError(e.message);
    }
  }

  async approve(item, decision, reason) {
    try {
      await this.api.json('POST', `/api/conversations/${this.conv.id}/approval`, { item: item.id, decision, reason: reason || undefined });
    } catch (e) {
      this.showError(e.message);
    }
  }

  /** The page in a sandboxed frame: by URL, or (with a key, which a frame's own request
   * cannot carry) as a blob of the bytes fetched with the key. */
  async preview(path) {
    const url = `/api/conversations/${this.conv.id}/file?path=${encodeURIComponent(path)}`;
    let src = url;
    if (this.api.key) {
      const res = await this.api.fetch('GET', url);
      if (!res.ok) {
        this.showError(`The preview could not be loaded (${res.status}).`);
        return;
      }
      src = URL.createObjectURL(await res.blob());
    }
    this.closePreview();
    this.previewFrame = h('iframe', { class: 'agent-frame', sandbox: 'allow-scripts', title: `Preview of ${path}`, src });
    fill(this.previewBox, h('div', { class: 'agent-preview-bar' }, h('span', { text: path }), h('div', { class: 'spacer' }),
      h('button', { type: 'button', text: 'Close preview', on: { click: () => this.closePreview() } })), this.previewFrame);
    this.previewBox.hidden = false;
  }

  closePreview() {
    if (this.previewFrame && this.previewFrame.src.startsWith('blob:')) URL.revokeObjectURL(this.previewFrame.src);
    this.previewFrame = null;
    this.previewBox.replaceChildren();
    this.previewBox.hidden = true;
  }

  showError(message) {
    this.errorEl.textContent = message;
    this.errorEl.hidden = false;
  }
}
