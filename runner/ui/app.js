// The operator page: hash routes (#/host, #/chat/USER/CHAT), the token, errors.

import { NotFound, Unauthorized, token } from "./api.js";
import { clear, el } from "./dom.js";
import { chatForm, chatPage } from "./chat.js";
import { hostPage } from "./host.js";

const $ = (id) => document.getElementById(id);

function say(text, kind = "error") {
  const box = $("message");
  box.className = `message message-${kind}`;
  box.textContent = text;
  box.hidden = !text;
}

function askForToken(rejected) {
  $("token-panel").hidden = false;
  $("forget-token").hidden = true;
  clear($("view"));
  say(rejected
    ? "The service token was not accepted (HTTP 401). Paste the token from the file named by CLOUD_AGENT_SERVICE_TOKEN_FILE."
    : "");
  $("token-input").focus();
}

function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  if (parts[0] === "chat") return { page: "chat", user: parts[1] || "", chat: parts[2] || "" };
  return { page: "host" };
}

// Each navigation renders into a detached node; only the latest one is shown, so a slow
// answer for a page the operator already left never replaces the page they are on.
let generation = 0;

async function render() {
  const gen = ++generation;
  const r = route();
  for (const [id, page] of [["nav-host", "host"], ["nav-chat", "chat"]]) {
    if (r.page === page) $(id).setAttribute("aria-current", "page"); else $(id).removeAttribute("aria-current");
  }
  document.title = r.page === "chat" && r.chat ? `Chat ${r.chat} · inspector` : `${r.page === "chat" ? "Chat" : "Host"} · inspector`;
  if (!token.get()) {
    askForToken(false);
    return;
  }
  $("token-panel").hidden = true;
  $("forget-token").hidden = false;
  say("");
  const view = $("view");
  delete view.dataset.ready;
  clear(view).append(el("p", { class: "loading" }, "Loading…"));
  const next = el("div", { class: "page" });
  try {
    if (r.page === "chat") await chatPage(next, r.user, r.chat);
    else await hostPage(next);
    if (gen !== generation) return;
    clear(view).append(next);
    view.dataset.ready = r.page;
  } catch (err) {
    if (gen !== generation) return;
    if (err instanceof Unauthorized) {
      token.clear();
      askForToken(true);
    } else if (err instanceof NotFound && r.page === "chat") {
      clear(view).append(chatForm(r.user, r.chat));
      say(`No chat "${r.chat}" of user "${r.user}" on this host.`);
    } else {
      clear(view);
      say(`The daemon answered with an error: ${err.message}`);
    }
  }
}

$("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const value = $("token-input").value.trim();
  if (!value) return;
  token.set(value);
  $("token-input").value = "";
  render();
});
$("forget-token").addEventListener("click", () => {
  token.clear();
  askForToken(false);
});
window.addEventListener("hashchange", render);
render();
