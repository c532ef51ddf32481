// The daemon's JSON routes, with the service token this tab was given.

const KEY = "cloud-agent-inspector-token";

export class Unauthorized extends Error {}
export class NotFound extends Error {}
export class ApiError extends Error {
  constructor(status, body) {
    super(`HTTP ${status}: ${typeof body === "string" ? body : JSON.stringify(body)}`);
    this.status = status;
    this.body = body;
  }
}

export const token = {
  get: () => sessionStorage.getItem(KEY),
  set: (value) => sessionStorage.setItem(KEY, value),
  clear: () => sessionStorage.removeItem(KEY),
};

export async function getJSON(path) {
  const value = token.get();
  if (!value) throw new Unauthorized("no token yet");
  const resp = await fetch(path, {
    headers: { authorization: `Bearer ${value}`, accept: "application/json" },
    cache: "no-store",
  });
  if (resp.status === 401) throw new Unauthorized("token rejected");
  let body;
  try { body = await resp.json(); } catch { body = await resp.text(); }
  if (resp.status === 404) throw new NotFound(body && body.detail ? body.detail : "not found");
  if (!resp.ok) throw new ApiError(resp.status, body);
  return body;
}

const seg = encodeURIComponent;
export const chatPath = (user, chat) => `/v1/users/${seg(user)}/chats/${seg(chat)}`;
