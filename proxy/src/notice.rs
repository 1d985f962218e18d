//! A notice to the agent in its provider's own answer format: what the
//! agent gets instead of the LLM's answer when the engine rolled its turn
//! back (a safety rule), so that any SDK reads it as an ordinary assistant
//! message, streamed when the request asked for a stream.

use serde_json::{json, Value};

use crate::route::Api;
use crate::transcript::{RecordedBody, RecordedResponse, StreamEnd};

/// The answer carrying `text` to the request `body` spoken in `api`.
pub(crate) fn response(api: Api, body: &[u8], text: &str) -> RecordedResponse {
    let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let model = req.get("model").and_then(Value::as_str).unwrap_or("crab");
    let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let created = crate::transcript::unix_ms() / 1000;
    let (content_type, bytes) = match (api, stream) {
        (Api::OpenAiChat, false) => ("application/json", chat(model, created, text).to_string()),
        (Api::OpenAiChat, true) => ("text/event-stream", chat_stream(model, created, text)),
        (Api::AnthropicMessages, false) => ("application/json", message(model, text).to_string()),
        (Api::AnthropicMessages, true) => ("text/event-stream", message_stream(model, text)),
        (Api::OpenAiResponses, false) => ("application/json", responses(model, created, text).to_string()),
        (Api::OpenAiResponses, true) => ("text/event-stream", responses_stream(model, created, text)),
        (Api::Other, _) => (
            "application/json",
            json!({"type": "error", "error": {"type": "crab_rolled_back", "message": text}}).to_string(),
        ),
    };
    RecordedResponse {
        status: 200,
        headers: vec![
            ("content-type".to_owned(), content_type.to_owned()),
            ("x-crab-notice".to_owned(), "rolled-back".to_owned()),
        ],
        n_bytes: bytes.len() as u64,
        body: RecordedBody::Text(bytes),
        capped: false,
        end: StreamEnd::Complete,
    }
}

fn sse(events: &[(Option<&str>, Value)]) -> String {
    let mut out = String::new();
    for (event, data) in events {
        if let Some(e) = event {
            out.push_str(&format!("event: {e}\n"));
        }
        out.push_str(&format!("data: {data}\n\n"));
    }
    out
}

fn chat(model: &str, created: u64, text: &str) -> Value {
    json!({
        "id": "chatcmpl-crab-notice", "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    })
}

fn chat_stream(model: &str, created: u64, text: &str) -> String {
    let chunk = |delta: Value, finish: Value| {
        json!({
            "id": "chatcmpl-crab-notice", "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    };
    let mut out = sse(&[
        (
            None,
            chunk(json!({"role": "assistant", "content": text}), Value::Null),
        ),
        (None, chunk(json!({}), json!("stop"))),
    ]);
    out.push_str("data: [DONE]\n\n");
    out
}

fn message(model: &str, text: &str) -> Value {
    json!({
        "id": "msg_crab_notice", "type": "message", "role": "assistant", "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    })
}

fn message_stream(model: &str, text: &str) -> String {
    let mut start = message(model, "");
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    sse(&[
        (
            Some("message_start"),
            json!({"type": "message_start", "message": start}),
        ),
        (
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        (
            Some("content_block_delta"),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
        ),
        (
            Some("content_block_stop"),
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            Some("message_delta"),
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                   "usage": {"output_tokens": 0}}),
        ),
        (Some("message_stop"), json!({"type": "message_stop"})),
    ])
}

fn responses(model: &str, created: u64, text: &str) -> Value {
    json!({
        "id": "resp_crab_notice", "object": "response", "created_at": created, "status": "completed",
        "model": model,
        "output": [{
            "type": "message", "id": "msg_crab_notice", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }],
        "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
    })
}

fn responses_stream(model: &str, created: u64, text: &str) -> String {
    let done = responses(model, created, text);
    let mut started = done.clone();
    started["status"] = json!("in_progress");
    started["output"] = json!([]);
    sse(&[
        (
            Some("response.created"),
            json!({"type": "response.created", "sequence_number": 0, "response": started}),
        ),
        (
            Some("response.output_text.delta"),
            json!({"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_crab_notice",
                   "output_index": 0, "content_index": 0, "delta": text}),
        ),
        (
            Some("response.completed"),
            json!({"type": "response.completed", "sequence_number": 2, "response": done}),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(r: &RecordedResponse) -> String {
        String::from_utf8(r.body.to_bytes().unwrap().to_vec()).unwrap()
    }

    #[test]
    fn each_api_gets_its_own_shape() {
        let text = "rolled \"back\"\nline two";
        let r = response(Api::OpenAiChat, br#"{"model":"gpt","messages":[]}"#, text);
        let v: Value = serde_json::from_str(&body(&r)).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], text);
        assert_eq!(v["model"], "gpt");
        let r = response(Api::OpenAiChat, br#"{"stream":true}"#, text);
        let b = body(&r);
        assert!(b.ends_with("data: [DONE]\n\n"), "{b}");
        let first: Value =
            serde_json::from_str(b.lines().next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(first["choices"][0]["delta"]["content"], text);
        let r = response(Api::AnthropicMessages, br#"{"model":"claude"}"#, text);
        let v: Value = serde_json::from_str(&body(&r)).unwrap();
        assert_eq!(v["content"][0]["text"], text);
        let r = response(Api::AnthropicMessages, br#"{"stream":true}"#, text);
        let text_body = body(&r);
        let events: Vec<&str> = text_body
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .collect();
        assert_eq!(
            events,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        let r = response(Api::OpenAiResponses, b"not json", text);
        let v: Value = serde_json::from_str(&body(&r)).unwrap();
        assert_eq!(v["output"][0]["content"][0]["text"], text);
        assert!(r.is_complete());
        assert_eq!(r.status, 200);
    }
}
