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
        // No answer format to speak: the error shape, as the proxy's errors.
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

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn output_message(text: &str, status: &str) -> Value {
    let content = if status == "completed" {
        json!([output_text(text)])
    } else {
        json!([])
    };
    json!({"type": "message", "id": "msg_crab_notice", "status": status, "role": "assistant", "content": content})
}

fn responses(model: &str, created: u64, text: &str) -> Value {
    json!({
        "id": "resp_crab_notice", "object": "response", "created_at": created, "status": "completed",
        "model": model, "output": [output_message(text, "completed")],
        "error": null, "incomplete_details": null, "instructions": null, "metadata": {},
        "parallel_tool_calls": true, "temperature": null, "top_p": null, "tool_choice": "auto", "tools": [],
        "usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0},
    })
}

/// The events of a streamed answer, in the order SDKs' stream helpers
/// check (an item, its part, the text, then each closed).
fn responses_stream(model: &str, created: u64, text: &str) -> String {
    let done = responses(model, created, text);
    let mut started = done.clone();
    started["status"] = json!("in_progress");
    started["output"] = json!([]);
    started["usage"] = Value::Null;
    let at = |n: u64, mut event: Value| {
        event["sequence_number"] = json!(n);
        (event["type"].as_str().map(str::to_owned), event)
    };
    let item = json!({"item_id": "msg_crab_notice", "output_index": 0, "content_index": 0});
    let with = |mut base: Value, extra: Value| {
        if let (Some(b), Some(e)) = (base.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        base
    };
    let events = [
        at(
            0,
            json!({"type": "response.created", "response": started.clone()}),
        ),
        at(1, json!({"type": "response.in_progress", "response": started})),
        at(
            2,
            json!({"type": "response.output_item.added", "output_index": 0, "item": output_message(text, "in_progress")}),
        ),
        at(
            3,
            with(
                item.clone(),
                json!({"type": "response.content_part.added", "part": output_text("")}),
            ),
        ),
        at(
            4,
            with(
                item.clone(),
                json!({"type": "response.output_text.delta", "delta": text, "logprobs": []}),
            ),
        ),
        at(
            5,
            with(
                item.clone(),
                json!({"type": "response.output_text.done", "text": text, "logprobs": []}),
            ),
        ),
        at(
            6,
            with(
                item,
                json!({"type": "response.content_part.done", "part": output_text(text)}),
            ),
        ),
        at(
            7,
            json!({"type": "response.output_item.done", "output_index": 0, "item": output_message(text, "completed")}),
        ),
        at(8, json!({"type": "response.completed", "response": done})),
    ];
    let mut out = String::new();
    for (name, data) in events {
        out.push_str(&format!("event: {}\ndata: {data}\n\n", name.unwrap_or_default()));
    }
    out
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
