// The key prompt: shown when the server answers 401; resolves with the key typed.

import { byId } from './dom.js';

export function askKey(refused) {
  const dialog = byId('key-dialog');
  const input = byId('key-input');
  const error = byId('key-error');
  const submit = byId('key-submit');
  error.hidden = !refused;
  error.textContent = refused ? 'The server refused that key. Check it and try again.' : '';
  input.value = '';
  return new Promise((resolve) => {
    const done = () => {
      const key = input.value.trim();
      if (!key) {
        input.focus();
        return;
      }
      submit.removeEventListener('click', done);
      input.removeEventListener('keydown', onKey);
      dialog.removeEventListener('cancel', onCancel);
      dialog.close();
      resolve(key);
    };
    const onKey = (e) => {
      if (e.key === 'Enter') {
        e.preventDefault();
        done();
      }
    };
    const onCancel = (e) => e.preventDefault(); // nothing works without the key
    submit.addEventListener('click', done);
    input.addEventListener('keydown', onKey);
    dialog.addEventListener('cancel', onCancel);
    if (!dialog.open) dialog.showModal();
    input.focus();
  });
}
